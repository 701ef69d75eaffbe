"""Hybrid parallelism under --sync ps: each group's layers go through the servers and train as under all-reduce."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import convoy_in_process


JOB = ("--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1", "--model", "lenet", "--batch-size", "8",
       "--steps", "8", "--sub-batches", "2", "--no-progress")


@pytest.mark.timeout(600)
def test_hybrid_with_a_parameter_server_equals_hybrid_allreduce(tmp_path):
    """The server (the last rank) averages the conv layers over the conv group and the head over the FC group,
    as the groups' all-reduces do; the FC worker runs its part on two pieces a step and still announces once."""
    runs = {"allreduce": ("--nproc", "3"), "ps": ("--nproc", "4", "--sync", "ps", "--servers", "1")}
    for name, extra in runs.items():
        result = convoy_in_process("train", *JOB, *extra, "--out", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
    reference, served = (torch.load(tmp_path / name / "model.pt")["model"] for name in runs)
    assert set(reference) == set(served)
    for key, value in reference.items():
        assert (served[key] - value).abs().max().item() <= 1e-6, key
