"""What the tests of resumes on another number of workers share: running a job, reading a checkpoint's
files at one step, checking the mean over workers and that a directory is untouched."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from convoy.checkpoint.recovery import rank_file_tensors, scan, state_dict_of, valid_steps
from convoy.checkpoint.store import Store
from tests.helpers import convoy_in_process

# A constant learning rate: a cosine schedule over a shorter first run would differ from the whole run's.
LENET = ("--model", "lenet", "--batch-size", "12", "--seed", "6", "--no-progress", "--eval-every", "0",
         "--lr-schedule", "constant")


def train(nproc: int, steps: int, out: Path, checkpoints: Path | None, *job: str):
    """``convoy train --nproc nproc`` of ``job`` for ``steps`` steps; it must succeed."""
    extra = ("--checkpoint-dir", str(checkpoints)) if checkpoints is not None else ()
    done = convoy_in_process("train", "--nproc", str(nproc), *job, "--steps", str(steps), *extra, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return done


def rank_state(directory: Path, rank: int, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``rank``'s file at ``step`` (empty when it holds no such step)."""
    return {f"{kind}.{key}": value for kind in ("buffer", "sync", "rng", "scaler")
            for key, value in rank_file_tensors(directory / f"state-rank{rank}.ckpt", kind, step).items()}


def model_at(path: Path, step: int) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict]:
    """A model file's parameters (``layer.param``), optimizer state by layer and record extra at ``step``."""
    store = Store.open(path)
    try:
        report = valid_steps(scan(store))[step]
        params, states = state_dict_of(store, report.area)
        return params, states, report.record.extra
    finally:
        store.close()


def assert_mean_kept(old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    """sum(new) / M == sum(old) / N exactly: N * sum(new) - M * sum(old) == 0 element by element, summed
    without rounding (math.fsum of float64 values that are exact multiples of float32 ones)."""
    n, m = len(old), len(new)
    columns = [(n * t.double()).reshape(-1).tolist() for t in new] + [(-m * t.double()).reshape(-1).tolist()
                                                                        for t in old]
    wrong = [i for i, values in enumerate(zip(*columns)) if math.fsum(values) != 0.0]
    assert not wrong, f"{len(wrong)} elements lost or gained, the first at {wrong[0]}"


def fingerprint(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directory`` by name: its modification time and its bytes' hash."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}
