"""Colocated servers with checkpoints: every rank writes its own shard (parameters, optimizer state) and
its worker's state; SIGKILL a 3-process job at a random moment after its first checkpoint, resume from
the same directory, and end bit-identical to an uninterrupted run (dense and with blocktopk pushes)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import convoy_in_process, kill_at_checkpoint

STEPS = 24
JOB = ("--nproc", "3", "--sync", "ps", "--servers", "colocated", "--model", "lenet", "--batch-size", "8",
       "--steps", str(STEPS), "--no-progress", "--timeout", "120", "--checkpoint-every", "2")
COMPRESS = {"dense": (), "blocktopk": ("--compress", "blocktopk", "--block-fraction", "0.25")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("compress", sorted(COMPRESS))
def test_a_killed_colocated_run_resumes_bit_identical(tmp_path, compress):
    args = JOB + COMPRESS[compress]
    whole = convoy_in_process("train", *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    rng = random.Random(20261125)
    kill_at_checkpoint([*args, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")],
                       tmp_path / "ckpt", files=3, step=rng.randrange(2, STEPS // 2, 2), delay_s=rng.uniform(0, 0.05))
    assert all((tmp_path / "ckpt" / f"model-rank{rank}.ckpt").exists() for rank in range(3))   # a shard each
    resumed = convoy_in_process("train", *args, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    expected, got = (torch.load(tmp_path / run / "model.pt")["model"] for run in ("whole", "b"))
    assert set(expected) == set(got)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
