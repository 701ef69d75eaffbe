"""A blocktopk job that loses a worker goes on from the step it was killed at, not its last full snapshot.

Its rank files (each worker's error-feedback residuals and momentum-correction
velocities) are written at every checkpoint by default, like PowerSGD's, while
its model file stays differential (a full snapshot every 10 to 100
checkpoints, the sparse update in between). A job of 4 workers SIGKILLed at a
random step, each process at once, resumes on 3 at the newest step every file
committed: the killed step or later, past the last full snapshot, with the
mean over the workers of every residual and velocity of that step kept bit for
bit. Each run draws its kill from its own seed, which a failure names;
``CONVOY_KILL_SEED=S`` replays it.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.recovery import restore_points, scan, valid_steps
from convoy.checkpoint.store import Store
from tests.checkpoint.elastic_helpers import LENET, assert_mean_kept, rank_state, train
from tests.helpers import kill_at_checkpoint

# Full snapshots after the first step and 50 checkpoints later: the kills, from step 14 to 39, fall
# between them (auto, the default, would choose 10 to 100 apart, as the machine measures).
JOB = (*LENET, "--compress", "blocktopk", "--block-fraction", "0.05", "--checkpoint-full-every", "50")
STEPS = 60


def _newest_common_step(directory: Path, world: int) -> tuple[int, int]:
    """The newest step the model file can restore and every rank file holds, and the step of the
    full snapshot it extends."""
    store = Store.open(model_file(directory, 0))
    try:
        points = restore_points(model_file(directory, 0), scan(store))
    finally:
        store.close()
    held = set(points)
    for rank in range(world):
        store = Store.open(rank_file(directory, rank))
        try:
            held &= set(valid_steps(scan(store)))
        finally:
            store.close()
    step = max(held)
    return step, points[step].report.record.step


@pytest.mark.timeout(600)
def test_a_blocktopk_job_killed_at_a_random_step_resumes_on_three_there_its_residuals_mean_kept(tmp_path):
    seed = int(os.environ.get("CONVOY_KILL_SEED", random.randrange(2 ** 31)))
    rng = random.Random(seed)
    killed_at = rng.randrange(14, 40)
    directory = tmp_path / "ckpt"
    kill_at_checkpoint(("--nproc", "4", *JOB, "--steps", str(STEPS), "--checkpoint-dir", str(directory),
                        "--out", str(tmp_path / "killed")), directory, files=1, step=killed_at,
                       delay_s=rng.uniform(0.0, 0.05))
    step, snapshot = _newest_common_step(directory, 4)
    where = f"seed {seed}: killed once step {killed_at} was committed; every file holds {step}"
    # A rank's file commits a step before the model file does: every one holds the killed step.
    assert step >= killed_at and snapshot < killed_at, f"{where}, the last full snapshot is {snapshot}"
    before = [rank_state(directory, rank, step) for rank in range(4)]
    additive = [k for k in before[0] if k.split(".")[1] in ("residual", "velocity")]
    assert {k.split(".")[1] for k in additive} == {"residual", "velocity"}, where

    done = train(3, step + 1, tmp_path / "resumed", directory, *JOB)
    assert f"written by 4 workers; resuming on 3: global batch 48 kept (16 per worker), per-rank state " \
           f"re-dealt at step {step}" in done.stderr, (where, done.stderr)
    assert "trained again" not in done.stderr, (where, done.stderr)
    after = [rank_state(directory, rank, step) for rank in range(3)]   # the re-dealt area
    for key in additive:
        assert_mean_kept([s[key] for s in before], [s[key] for s in after])
