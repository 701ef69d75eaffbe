"""The README's Python API example, run as a user would, and the plug points' contracts."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import convoy
from convoy.compress import FP16Compressor, ResidualMemory, build_compressor
from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "own_loop.py"


@pytest.mark.timeout(240)
def test_the_api_example_trains_under_torchrun():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(EXAMPLE)],
                            capture_output=True, text=True, timeout=180, env={**os.environ})
    assert result.returncode == 0, result.stderr
    # Two processes share stdout, so their lines may run together.
    accuracies = dict(re.findall(r"rank (\d): test accuracy ([0-9.]+)", result.stdout))
    assert sorted(accuracies) == ["0", "1"]
    # Both ranks hold the same model, so they score the same.
    assert accuracies["0"] == accuracies["1"]
    # Seeded and scheduled (10 epochs, cosine): 0.975 here; the bound leaves room
    # for another CPU's float rounding, while an untrained or broken run scores ~0.1.
    assert float(accuracies["0"]) >= 0.95


def test_init_without_torchrun_is_a_world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ctx = convoy.init()
    assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=64), st.integers(1, 4))
def test_error_feedback_conserves_the_gradient(values, steps):
    compressor, memory = FP16Compressor(), ResidualMemory()
    grad = torch.tensor(values, dtype=torch.float32) / 3
    for _ in range(steps):
        old = memory.residuals.get("w", torch.zeros_like(grad))
        compensated = memory.compensate(grad, "w")
        payload, ctx = compressor.compress(compensated, "w")
        sent = compressor.decompress(payload, ctx)
        memory.update(compensated, "w", sent)
        assert torch.equal(sent + memory.residuals["w"], grad + old)


def test_identity_compressor_sends_the_gradient_unchanged():
    compressor, memory = build_compressor("none")
    grad = torch.randn(100)
    payload, ctx = compressor.compress(memory.compensate(grad, "w"), "w")
    assert torch.equal(compressor.decompress(payload, ctx), grad)
