"""Colocated servers with checkpoints: every rank writes its own shard (parameters, optimizer state) and
its worker's state; SIGKILL a 3-process job at a random moment after its first checkpoint, resume from
the same directory, and end bit-identical to an uninterrupted run (dense and with blocktopk pushes)."""
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

STEPS = 24
JOB = ("--nproc", "3", "--sync", "ps", "--servers", "colocated", "--model", "lenet", "--batch-size", "8",
       "--steps", str(STEPS), "--no-progress", "--timeout", "120", "--checkpoint-every", "2")
COMPRESS = {"dense": (), "blocktopk": ("--compress", "blocktopk", "--block-fraction", "0.25")}


def _kill_after_first_checkpoint(args: tuple[str, ...], ckpt: Path, out: Path, delay_s: float) -> bool:
    """Start the checkpointing run, SIGKILL all its processes ``delay_s`` after every rank committed step 1.

    Returns whether the run was still going when killed.
    """
    proc = subprocess.Popen([sys.executable, "-m", "convoy", "train", *args, "--checkpoint-dir", str(ckpt),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 420
        while min(committed_step(ckpt / f"model-rank{rank}.ckpt") for rank in range(3)) < 1:
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
@pytest.mark.parametrize("compress", sorted(COMPRESS))
def test_a_killed_colocated_run_resumes_bit_identical(tmp_path, compress):
    args = JOB + COMPRESS[compress]
    whole = convoy_in_process("train", *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    delay = random.Random(20261125).uniform(0.0, 0.5)
    assert _kill_after_first_checkpoint(args, tmp_path / "ckpt", tmp_path / "a", delay), "the run ended before the kill"
    assert all((tmp_path / "ckpt" / f"model-rank{rank}.ckpt").exists() for rank in range(3))   # a shard each
    resumed = convoy_in_process("train", *args, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    expected, got = (torch.load(tmp_path / run / "model.pt")["model"] for run in ("whole", "b"))
    assert set(expected) == set(got)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
