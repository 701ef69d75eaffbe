"""--grad-accum, --clip-grad-norm and --amp under --sync ps, against data-parallel all-reduce runs.

Two servers each own a shard, so the clipping norm and the fp16 skip decision
must combine both shards (and reach the workers, whose loss scale follows).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import convoy_in_process

STEPS = 6
LENET = ("--model", "lenet", "--steps", str(STEPS), "--no-progress")
CLIP = ("--clip-grad-norm", "0.05")   # lenet's gradient norm on digits is far above it: every step clips
PS2 = ("--nproc", "4", "--sync", "ps", "--servers", "2")   # 2 servers, 2 workers

# lenet on inputs x 100: its fp16 gradient overflows at the first loss scales, so steps are skipped.
LOUD_MODEL = '''
from torch import nn
from convoy.models import build_model


class Louder(nn.Module):
    def forward(self, x):
        return x * 100.0


def factory(in_channels, num_classes):
    model = build_model("lenet", in_channels=in_channels, num_classes=num_classes)
    model.features.insert(0, Louder())
    return model
'''
LOUD = ("--model", "loud.py:factory")

RUNS = {
    # 2 workers x 2 micro-batches of 8, clipped on 2 servers, and the all-reduce step on batches of 16.
    "ps_accum_clip": (*PS2, *LENET, "--batch-size", "8", "--grad-accum", "2", *CLIP),
    "allreduce_clip": ("--nproc", "2", *LENET, "--batch-size", "16", *CLIP),
    "ps_fp16": (*PS2, *LOUD, "--batch-size", "8", "--steps", "8", "--lr", "0.01", "--amp", "fp16", "--no-progress"),
    "allreduce_fp16": ("--nproc", "2", *LOUD, "--batch-size", "8", "--steps", "8", "--lr", "0.01", "--amp", "fp16",
                       "--no-progress"),
    "ps_bf16": ("--nproc", "3", "--sync", "ps", "--servers", "1", "--model", "lenet", "--batch-size", "16", "--steps", "30",
                "--lr", "0.1", "--amp", "bf16", "--no-progress"),
    "ps_blocktopk_clip": ("--nproc", "3", "--sync", "ps", "--servers", "1", *LENET, "--batch-size", "16", "--compress", "blocktopk",
                          *CLIP),
}


# The run folder of each argument list trained so far in this session: modules comparing against
# the same reference run (data-parallel clipping) train it once.
_TRAINED: dict[tuple[str, ...], Path] = {}


def train_runs(root: Path, runs: dict[str, tuple[str, ...]]) -> Path:
    """``convoy train`` with each run's arguments, into ``root/<name>`` (``loud.py`` is there to load).

    The launcher is this process (the command line is not what these tests check); an argument
    list already trained in this session is linked to, not trained again.
    """
    (root / "loud.py").write_text(LOUD_MODEL)
    for name, args in runs.items():
        if args in _TRAINED:
            (root / name).symlink_to(_TRAINED[args], target_is_directory=True)
            continue
        with contextlib.chdir(root):
            result = convoy_in_process("train", *args, "--out", str(root / name))
        assert result.returncode == 0, f"{name}: {result.stderr}"
        _TRAINED[args] = root / name
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return train_runs(tmp_path_factory.mktemp("precision_ps"), RUNS)


def model_state(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt")["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def step_records(run: Path, rank: int) -> list[dict]:
    records = [json.loads(line) for line in (run / f"metrics-rank{rank}.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


@pytest.mark.timeout(1500)
def test_accumulated_and_clipped_ps_steps_equal_allreduce_on_the_larger_batch(runs):
    """Micro-batches sum on the workers; the norm over both servers' shards clips as all-reduce's does."""
    assert max_difference(model_state(runs / "ps_accum_clip"), model_state(runs / "allreduce_clip")) <= 1e-5
    for rank in range(4):   # every rank, workers included, learnt the same global norm, above the limit
        norms = [r["grad_norm"] for r in step_records(runs / "ps_accum_clip", rank)]
        assert len(norms) == STEPS and all(n > 0.05 for n in norms)
        reference = [r["grad_norm"] for r in step_records(runs / "allreduce_clip", 0)]
        assert norms == pytest.approx(reference, rel=1e-5)


@pytest.mark.timeout(1500)
def test_fp16_skips_the_same_steps_on_every_worker_and_server(runs):
    assert max_difference(model_state(runs / "ps_fp16"), model_state(runs / "allreduce_fp16")) <= 1e-5
    scales = [[r["loss_scale"] for r in step_records(runs / "ps_fp16", rank)] for rank in range(4)]
    assert all(s == scales[0] for s in scales[1:])
    assert scales[0] == [r["loss_scale"] for r in step_records(runs / "allreduce_fp16", 0)]
    assert scales[0][0] == 2.0 ** 16 and scales[0][-1] < 2.0 ** 16   # steps overflowed and were skipped
    assert all(math.isfinite(r["loss"]) for r in step_records(runs / "ps_fp16", 0))


@pytest.mark.timeout(1500)
def test_bf16_trains(runs):
    summary = json.loads((runs / "ps_bf16" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.5
    assert all(math.isfinite(r["loss"]) for r in step_records(runs / "ps_bf16", 0))


@pytest.mark.timeout(1500)
def test_clipping_a_block_topk_compressed_step(runs):
    """The server clips the decoded average of the sparse pushes; the workers learn the same norm."""
    norms = [[r["grad_norm"] for r in step_records(runs / "ps_blocktopk_clip", rank)] for rank in range(3)]
    assert all(n == norms[0] for n in norms[1:])
    assert len(norms[0]) == STEPS and all(math.isfinite(n) and n > 0.05 for n in norms[0])
