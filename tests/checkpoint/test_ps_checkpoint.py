"""Parameter server with checkpoints: SIGKILL a 3-process job at a random moment, resume, end bit-identical.

The server's file holds its shard (parameters and optimizer state, written as
each layer is updated); each worker's rank file its own state. A run killed
(every process at once) at a random moment after its first checkpoint and
resumed from the same directory must end with exactly the parameters and
optimizer state of an uninterrupted run.
"""
from __future__ import annotations

import random

import pytest
import torch

from convoy.checkpoint.files import committed_step
from tests.helpers import convoy_in_process, kill_at_checkpoint

STEPS = 30
JOB = ("--nproc", "3", "--sync", "ps", "--servers", "1", "--model", "lenet", "--batch-size", "8",
       "--steps", str(STEPS), "--no-progress", "--timeout", "120")


@pytest.mark.timeout(900)
def test_a_killed_ps_run_resumes_bit_identical(tmp_path):
    whole = convoy_in_process("train", *JOB, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    rng = random.Random(20261125)
    kill_at_checkpoint([*JOB, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")],
                       tmp_path / "ckpt", files=1, step=rng.randrange(1, STEPS // 2), delay_s=rng.uniform(0, 0.05))
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
