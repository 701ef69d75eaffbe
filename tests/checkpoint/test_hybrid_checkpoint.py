"""Hybrid parallelism with checkpoints: each group persists its own layers; resume and export are exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import convoy_in_process


# 2 conv workers read 128 samples each: 5 steps an epoch, so 12 steps cross two epochs. fp16 without
# momentum correction keeps the momentum in the layers' optimizers, whose export is checked below.
JOB = ("--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1", "--nproc", "3",
       "--batch-size", "128", "--lr-schedule", "constant", "--compress", "fp16", "--no-momentum-correction",
       "--no-progress")


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> Path:
    """An uninterrupted 12-step hybrid run, and one stopped after 7 steps then resumed to 12."""
    tmp = tmp_path_factory.mktemp("hybrid_resume")
    for steps, extra, out in ((12, (), "whole"), (7, ("--checkpoint-dir", str(tmp / "ckpt")), "a"),
                              (12, ("--checkpoint-dir", str(tmp / "ckpt")), "b")):
        result = convoy_in_process("train", *JOB, "--steps", str(steps), *extra, "--out", str(tmp / out))
        assert result.returncode == 0, result.stderr
    assert "at step 7 (epoch 1, batch 2)" in result.stderr
    return tmp


@pytest.mark.timeout(600)
def test_each_group_writes_its_own_layers_and_resume_is_bit_identical(hybrid_runs):
    files = sorted(p.name for p in (hybrid_runs / "ckpt").glob("model-rank*.ckpt"))
    assert files == ["model-rank0.ckpt", "model-rank2.ckpt"]   # conv group's writer, FC group's writer
    whole = torch.load(hybrid_runs / "whole" / "model.pt")["model"]
    resumed = torch.load(hybrid_runs / "b" / "model.pt")["model"]
    assert set(whole) == set(resumed)
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.timeout(600)
def test_export_puts_the_groups_back_together_under_the_models_names(hybrid_runs):
    out = hybrid_runs / "exported.pt"
    result = convoy_in_process("checkpoint", "export", str(hybrid_runs / "ckpt"), str(out))
    assert result.returncode == 0, result.stderr
    exported = torch.load(out, weights_only=True)
    final = torch.load(hybrid_runs / "whole" / "model.pt")["model"]
    assert exported["step"] == 12 and set(exported["model"]) == set(final)
    for key, value in final.items():
        assert torch.equal(exported["model"][key], value), key
    # One optimizer per layer of the whole model, conv layers first, each with its momentum.
    assert len(exported["optimizers"]) == len(exported["layers"]) == 5
    assert all(opt["state"] for opt in exported["optimizers"])

