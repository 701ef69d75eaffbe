"""Parameter server with checkpoints: SIGKILL a 3-process job at a random moment, resume, end bit-identical.

The server's file holds its shard (parameters and optimizer state, written as
each layer is updated); each worker's rank file its own state. A run killed
(every process at once) at a random moment after its first checkpoint and
resumed from the same directory must end with exactly the parameters and
optimizer state of an uninterrupted run.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convoy.checkpoint.listener import committed_step
from tests.helpers import convoy_in_process

STEPS = 30
JOB = ("--nproc", "3", "--sync", "ps", "--servers", "1", "--model", "lenet", "--batch-size", "8",
       "--steps", str(STEPS), "--no-progress", "--timeout", "120")


def _kill_after_first_checkpoint(ckpt: Path, out: Path, delay_s: float) -> bool:
    """Start the checkpointing run, SIGKILL all its processes ``delay_s`` after step 1 is committed.

    Returns whether the run was still going when killed.
    """
    proc = subprocess.Popen([sys.executable, "-m", "convoy", "train", *JOB, "--checkpoint-dir", str(ckpt),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 420
        while committed_step(ckpt / "model-rank0.ckpt") < 1:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 420 s"
            time.sleep(0.01)
        time.sleep(delay_s)
        running = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return running
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(900)
def test_a_killed_ps_run_resumes_bit_identical(tmp_path):
    whole = convoy_in_process("train", *JOB, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    delay = random.Random(20261125).uniform(0.0, 1.0)
    assert _kill_after_first_checkpoint(tmp_path / "ckpt", tmp_path / "a", delay), "the run ended before the kill"
    committed = committed_step(tmp_path / "ckpt" / "model-rank0.ckpt")
    assert 1 <= committed < STEPS
    resumed = convoy_in_process("train", *JOB, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    expected, got = (torch.load(tmp_path / run / "model.pt") for run in ("whole", "b"))
    assert set(expected["model"]) == set(got["model"])
    for key, value in expected["model"].items():
        assert torch.equal(got["model"][key], value), key
    # Rank 0 is the server: its engine's per-layer optimizer state (momentum) is saved too.
    assert len(expected["optimizers"]) == len(got["optimizers"]) > 0
    for mine, theirs in zip(expected["optimizers"], got["optimizers"]):
        for index, state in mine["state"].items():
            assert torch.equal(theirs["state"][index]["momentum_buffer"], state["momentum_buffer"])
