"""Hierarchical sync with checkpoints: SIGKILL a 4-rank job at a random moment after its first
checkpoint, resume it, and end bit-identical to an uninterrupted run.

Each cluster persists its own model file (its members hold the same parameters
and momentum), checkpoints fall on exchange steps, and each rank's own file
keeps the cluster plan and the contribution history. The resumed run is
given a node profile that would cluster the ranks differently: it must keep
the clusters of the checkpoint, or its training would differ.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import convoy_in_process, kill_at_checkpoint, profile_toml, same_saved_models

# A job starts in seconds alone, in minutes on a machine shared with other test runs.
RUN_TIMEOUT_S = 600
STEPS = 40
JOB = ("--nproc", "4", "--sync", "hierarchical", "--clusters", "2", "--exchange-every", "2", "--batch-size", "8",
       "--steps", str(STEPS), "--no-progress")


@pytest.mark.timeout(1800)
def test_sigkilled_hierarchical_job_resumes_bit_identical(tmp_path):
    first, other = tmp_path / "first.toml", tmp_path / "other.toml"
    first.write_text(profile_toml(slow=(1, 3)))    # clusters {0, 2} and {1, 3}
    other.write_text(profile_toml(slow=(2, 3)))    # would be {0, 1} and {2, 3}
    checkpoints = tmp_path / "ckpt"

    whole = convoy_in_process("train", *JOB, "--node-profile", str(first), "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr

    rng = random.Random(20261125)
    target = rng.randrange(2, STEPS // 2, 2)   # checkpoints fall on exchange steps: even counts
    kill_at_checkpoint([*JOB, "--node-profile", str(first), "--checkpoint-dir", str(checkpoints),
                        "--out", str(tmp_path / "a")], checkpoints, files=2, step=target,
                       delay_s=rng.uniform(0.0, 0.05), timeout_s=RUN_TIMEOUT_S)
    # One model file per cluster, written by its first rank.
    assert sorted(p.name for p in checkpoints.glob("model-rank*.ckpt")) == ["model-rank0.ckpt", "model-rank1.ckpt"]

    resumed = convoy_in_process("train", *JOB, "--node-profile", str(other), "--checkpoint-dir", str(checkpoints),
                                "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    step = int(resumed.stderr.split("resumed from")[1].split("at step ")[1].split()[0])
    assert target <= step < STEPS and step % 2 == 0, resumed.stderr
    assert sorted(p.name for p in checkpoints.glob("model-rank*.ckpt")) == ["model-rank0.ckpt", "model-rank1.ckpt"]

    expected = torch.load(tmp_path / "whole" / "model.pt")
    got = torch.load(tmp_path / "b" / "model.pt")
    for key, value in expected["model"].items():
        assert torch.equal(got["model"][key], value), key
    for mine, theirs in zip(got["optimizers"], expected["optimizers"]):   # cluster 0's momentum
        for index, state in theirs["state"].items():
            assert torch.equal(mine["state"][index]["momentum_buffer"], state["momentum_buffer"])

    # The last checkpoint is an exchange step: both clusters' files hold the job's model.
    exported = convoy_in_process("checkpoint", "export", str(checkpoints), str(tmp_path / "exported.pt"))
    assert exported.returncode == 0, exported.stderr
    model = torch.load(tmp_path / "exported.pt", weights_only=True)["model"]
    for key, value in expected["model"].items():
        assert torch.equal(model[key], value), key


@pytest.mark.timeout(900)
def test_a_job_stopped_before_its_first_checkpoint_keeps_its_clusters(tmp_path):
    """Its clusters are kept beside the checkpoint files from the start: a job stopped before any
    checkpoint was committed (its files erased here) starts again with the clusters it first had,
    though its nodes now measure otherwise, and ends bit-identical to the uninterrupted run."""
    first, other = tmp_path / "first.toml", tmp_path / "other.toml"
    first.write_text(profile_toml(slow=(1, 3)))    # clusters {0, 2} and {1, 3}
    other.write_text(profile_toml(slow=(2, 3)))    # would be {0, 1} and {2, 3}
    job = (*JOB[:JOB.index("--steps")], "--steps", "6")
    checkpoints = tmp_path / "ckpt"
    whole = convoy_in_process("train", *job, "--node-profile", str(first), "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    started = convoy_in_process("train", *job, "--node-profile", str(first), "--checkpoint-dir", str(checkpoints),
                                "--out", str(tmp_path / "a"))
    assert started.returncode == 0, started.stderr
    for path in checkpoints.glob("*.ckpt*"):
        path.unlink()
    again = convoy_in_process("train", *job, "--node-profile", str(other), "--checkpoint-dir", str(checkpoints),
                              "--out", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr
    same_saved_models(tmp_path / "whole", tmp_path / "b")
