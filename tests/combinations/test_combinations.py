"""The techniques compose: each pairing docs/design.md's "What combines" table says yes to trains.

One short lenet job per pairing (the strategies of both techniques in one run), through the
convoy command with its own launcher. Each must exit 0, run every step, and end with finite
losses on every rank; the ones that checkpoint must leave a checkpoint that resumes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import convoy_in_process

STEPS = 6
PS = ("--sync", "ps", "--servers", "1")
HIERARCHICAL = ("--sync", "hierarchical", "--clusters", "2")
BLOCKTOPK = ("--compress", "blocktopk", "--block-fraction", "0.1")

COMBINATIONS = {
    "ps x blocktopk": ("--nproc", "3", *PS, *BLOCKTOPK),
    "ps x powersgd": ("--nproc", "3", *PS, "--compress", "powersgd"),
    "hierarchical x checkpoints": ("--nproc", "4", *HIERARCHICAL, "--checkpoint-dir", "{ck}"),
    "ps x checkpoints": ("--nproc", "3", *PS, "--checkpoint-dir", "{ck}"),
    "hybrid x hierarchical": ("--nproc", "5", "--parallel", "hybrid", "--conv-workers", "4", "--fc-workers", "1",
                              *HIERARCHICAL),
    "hybrid x ps": ("--nproc", "4", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1", *PS),
    "hybrid x powersgd x checkpoints": ("--nproc", "4", "--parallel", "hybrid", "--conv-workers", "3",
                                        "--fc-workers", "1", "--compress", "powersgd", "--checkpoint-dir", "{ck}"),
    "hierarchical x powersgd": ("--nproc", "4", *HIERARCHICAL, "--compress", "powersgd"),
    "hierarchical x blocktopk x checkpoints": ("--nproc", "4", *HIERARCHICAL, *BLOCKTOPK, "--checkpoint-dir", "{ck}"),
}


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for path in run.glob("metrics-rank*.jsonl") for line in path.read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind") == "step" and r.get("loss") is not None]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_the_combination_trains(tmp_path, flags):
    flags = tuple(f.replace("{ck}", str(tmp_path / "ck")) for f in flags)
    job = ("train", "--model", "lenet", "--batch-size", "8", "--no-progress", "--out", str(tmp_path / "run"), *flags)
    result = convoy_in_process(*job, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == STEPS
    losses = _losses(tmp_path / "run")
    assert losses and all(math.isfinite(loss) for loss in losses)
    if "--checkpoint-dir" in flags:
        resumed = convoy_in_process(*job, "--steps", str(STEPS + 2))
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resumed" in resumed.stdout + resumed.stderr
