"""--grad-accum, --clip-grad-norm and --amp under --parallel hybrid (all-reduce and ps), against data parallelism.

Each micro-batch crosses the link between the conv and the FC group, both
groups accumulate, and the clipping norm (and the fp16 skip decision) combines
the conv group's layers with the FC group's.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.ps.test_precision_ps import CLIP, LENET, LOUD, STEPS, max_difference, model_state, step_records, train_runs

HYBRID = ("--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1")
MICRO = ("--batch-size", "8", "--grad-accum", "2", "--sub-batches", "2")   # 2 micro-batches, each in 2 pieces

RUNS = {
    # Conv workers 0-1 take 2 micro-batches of 8 a step; data parallelism takes batches of 16 on 2 ranks.
    "hybrid_accum_clip": ("--nproc", "3", *HYBRID, *LENET, *MICRO, *CLIP),
    "hybrid_ps_accum_clip": ("--nproc", "4", *HYBRID, "--sync", "ps", "--servers", "1", *LENET, *MICRO, *CLIP),
    "data_clip": ("--nproc", "2", *LENET, "--batch-size", "16", *CLIP),
    "hybrid_fp16": ("--nproc", "3", *HYBRID, *LOUD, "--batch-size", "8", "--steps", "8", "--lr", "0.01",
                    "--amp", "fp16", "--no-progress"),
    "hybrid_ps_bf16": ("--nproc", "4", *HYBRID, "--sync", "ps", "--servers", "1", "--model", "lenet",
                       "--batch-size", "16", "--steps", "30", "--lr", "0.1", "--amp", "bf16", "--no-progress"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return train_runs(tmp_path_factory.mktemp("precision_hybrid"), RUNS)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["hybrid_accum_clip", "hybrid_ps_accum_clip"])
def test_accumulated_and_clipped_hybrid_steps_equal_data_parallelism(runs, name):
    assert max_difference(model_state(runs / name), model_state(runs / "data_clip")) <= 1e-5
    reference = [r["grad_norm"] for r in step_records(runs / "data_clip", 0)]
    assert all(n > 0.05 for n in reference)   # every step clipped
    ranks = 4 if "ps" in name else 3
    for rank in range(ranks):   # conv, FC (and server) ranks all clipped by the norm over both groups' layers
        assert [r["grad_norm"] for r in step_records(runs / name, rank)] == pytest.approx(reference, rel=1e-5)


@pytest.mark.timeout(1500)
def test_fp16_skips_the_same_steps_in_both_groups(runs):
    scales = [[r["loss_scale"] for r in step_records(runs / "hybrid_fp16", rank)] for rank in range(3)]
    assert all(s == scales[0] for s in scales[1:])
    assert scales[0][0] == 2.0 ** 16 and scales[0][-1] < 2.0 ** 16   # steps overflowed and were skipped
    assert all(math.isfinite(r["loss"]) for r in step_records(runs / "hybrid_fp16", 0))


@pytest.mark.timeout(1500)
def test_bf16_hybrid_with_a_parameter_server_trains(runs):
    summary = json.loads((runs / "hybrid_ps_bf16" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.5
    assert all(math.isfinite(r["loss"]) for r in step_records(runs / "hybrid_ps_bf16", 0))
