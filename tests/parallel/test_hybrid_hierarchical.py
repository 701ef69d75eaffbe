"""Hybrid parallelism with hierarchical sync inside its groups, as a user runs it.

The conv group is clustered on its own (the FC group of one rank is one
cluster and just trains); each cluster writes its own model file.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import convoy_in_process, profile_toml


COMMON = ("--batch-size", "8", "--steps", "6", "--no-progress")


def _steps(run, rank: int) -> list[dict]:
    lines = (run / f"metrics-rank{rank}.jsonl").read_text().splitlines()
    return [s for s in map(json.loads, lines) if s["kind"] == "step"]


@pytest.mark.timeout(1200)
def test_hierarchical_inside_the_conv_group_of_a_hybrid_job(tmp_path):
    profile = tmp_path / "nodes.toml"
    profile.write_text(profile_toml(slow=(1, 3)))   # conv workers {0, 2} and {1, 3}
    run, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    result = convoy_in_process("train", "--nproc", "5", "--parallel", "hybrid", "--conv-workers", "4",
                               "--fc-workers", "1", "--sync", "hierarchical", "--clusters", "2",
                               "--exchange-every", "2", "--node-profile", str(profile),
                               "--checkpoint-dir", str(checkpoints), *COMMON, "--out", str(run))
    assert result.returncode == 0, result.stderr
    for rank, cluster in ((0, 0), (2, 0), (1, 1), (3, 1)):
        for s in _steps(run, rank):
            assert s["role"] == "conv" and s["cluster"] == cluster
            assert s.get("exchange", False) == ((s["step"] + 1) % 2 == 0)
    assert all(s["role"] == "fc" and s["server"] == 4 and s["intra_cluster_bytes_sent"] == 0
               for s in _steps(run, 4))
    # One model file per conv cluster, one for the FC group.
    assert sorted(p.name for p in checkpoints.glob("model-rank*.ckpt")) == \
        ["model-rank0.ckpt", "model-rank1.ckpt", "model-rank4.ckpt"]


@pytest.mark.timeout(1200)
def test_one_cluster_of_two_conv_workers_trains_exactly_as_allreduce(tmp_path):
    """A cluster's server adds its two members' gradients, as a ring all-reduce of two does."""
    job = ("--nproc", "3", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1", *COMMON)
    for name, sync in (("flat", ("--sync", "allreduce")), ("hier", ("--sync", "hierarchical", "--clusters", "1"))):
        result = convoy_in_process("train", *job, *sync, "--out", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
    flat = torch.load(tmp_path / "flat" / "model.pt")["model"]
    hier = torch.load(tmp_path / "hier" / "model.pt")["model"]
    for key, value in flat.items():
        assert torch.equal(hier[key], value), key
