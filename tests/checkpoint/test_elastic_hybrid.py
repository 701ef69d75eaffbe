"""A hybrid job resumed with another layout: the layout checked, the state mapped by role
(convoy.train.elastic_layouts.relayout_hybrid)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convoy.checkpoint.export import export_checkpoint
from convoy.checkpoint.reshard import complete
from convoy.checkpoint.written import recorded_job
from convoy.train.elastic_layouts import relayout_hybrid

from tests.checkpoint.elastic_helpers import LENET, assert_mean_kept, fingerprint, rank_state, train
from tests.helpers import convoy_in_process, one_line_error, saved_model

# 2 conv workers of 12 samples: a global batch of 24. blocktopk writes differential checkpoints of each
# group's model file (their logs move with it) and keeps residuals; without momentum correction the
# momentum is in the optimizers, which the saved models compare too.
JOB = (*LENET, "--parallel", "hybrid", "--compress", "blocktopk", "--block-fraction", "0.05",
       "--no-momentum-correction")
STEP = 5


def _roles(conv: int, fc: int) -> tuple[str, ...]:
    return ("--conv-workers", str(conv), "--fc-workers", str(fc))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    train(3, STEP, tmp / "run", tmp / "ckpt", *JOB, *_roles(2, 1))
    return tmp


@pytest.mark.timeout(900)
@pytest.mark.parametrize("conv, fc", [(1, 1), (3, 1), (2, 2)])
def test_state_maps_by_role_onto_another_layout(checkpoint, tmp_path, conv, fc):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint / "ckpt", directory)
    world = conv + fc
    before = export_checkpoint(directory, tmp_path / "before.pt")
    # No step left to train: the model saved is the one the resume restored, the checkpoint's.
    done = train(world, STEP, tmp_path / "same", directory, *JOB, *_roles(conv, fc))
    assert (f"written by 3 workers; resuming on {world}: global batch 24 kept ({24 // conv} per conv worker), "
            f"conv layers from 2 workers to {conv}, FC head from 1 to {fc}") in done.stderr, done.stderr
    # The checkpoint's newest step is reached through each group's differential log (copied with it).
    restored, final = saved_model(tmp_path / "same"), saved_model(checkpoint / "run")
    assert restored.keys() == final.keys() and all(torch.equal(restored[k], v) for k, v in final.items())
    # The new layout's files hold the old snapshots' parameters and optimizer state (momentum) as they were.
    after = export_checkpoint(directory, tmp_path / "after.pt")
    assert after["layers"] == before["layers"] and after["step"] == before["step"]
    assert all(torch.equal(after["model"][key], value) for key, value in before["model"].items())
    for mine, theirs in zip(after["optimizers"], before["optimizers"]):
        assert theirs["state"] and mine["state"].keys() == theirs["state"].keys()
        for index, state in theirs["state"].items():
            assert torch.equal(mine["state"][index]["momentum_buffer"], state["momentum_buffer"])
    # Each group's model file went to its writer in the new layout; each group's rank files were
    # re-dealt within the group, the group's mean residual kept exactly.
    assert sorted(p.name for p in directory.glob("model-rank*.ckpt")) == ["model-rank0.ckpt",
                                                                          f"model-rank{conv}.ckpt"]
    old = [rank_state(checkpoint / "ckpt", r, STEP) for r in range(3)]
    new = [rank_state(directory, r, STEP) for r in range(world)]
    for before, after in (((0, 1), range(conv)), ((2,), range(conv, world))):
        keys = [k for k in old[before[0]] if k.startswith("sync.residual.")]
        assert keys and all(k in new[after[0]] for k in keys)
        for key in keys:
            assert_mean_kept([old[r][key] for r in before], [new[r][key] for r in after])
    # It trains on from there, its files keeping the re-dealt step beside the new one (they have the
    # layout the job's own checkpoints have: a rank file whose layout changes is created anew).
    done = train(world, STEP + 1, tmp_path / "more", directory, *JOB, *_roles(conv, fc))
    assert f"resumed from {directory} at step {STEP}" in done.stderr and "resuming on" not in done.stderr
    assert all(rank_state(directory, r, STEP) and rank_state(directory, r, STEP + 1) for r in range(world))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("roles, extra, expected", [
    ((3, 2), (), "--conv-workers (3) must be divisible by --fc-workers (2)"),
    ((5, 1), (), "the checkpoint's global batch of 24 does not divide over 5 conv workers"),
    ((1, 1), ("--sync", "hierarchical", "--clusters", "1"),
     "--parallel hybrid with --sync hierarchical resumes only on that number (2 given"),
])
def test_a_layout_that_cannot_be_mapped_is_refused_in_one_line_and_changes_nothing(checkpoint, tmp_path, roles,
                                                                                   extra, expected):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint / "ckpt", directory)
    before = fingerprint(directory)
    line = one_line_error(convoy_in_process("train", "--nproc", str(sum(roles)), *JOB, *_roles(*roles), *extra,
                                            "--steps", str(STEP + 2), "--checkpoint-dir", str(directory),
                                            "--out", str(tmp_path / "run")))
    assert expected in line
    assert fingerprint(directory) == before


def relayout_onto_one_plus_one(directory: Path) -> None:
    """What a start of a 1+1 job does to a 2+1 job's directory (convoy.train.elastic): finish a committed
    re-layout, else re-lay it out."""
    complete(directory)
    if recorded_job(directory).world == 3:
        relayout_hybrid(directory, (2, 1), (1, 1), ([0], [1]), {"world": 2, "global_batch": 24})


_RELAYOUT = ("import sys; from pathlib import Path; from tests.checkpoint.test_elastic_hybrid import "
             "relayout_onto_one_plus_one; relayout_onto_one_plus_one(Path(sys.argv[1]))")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", ["reshard:0", "reshard:1"])
def test_a_kill_during_the_re_layout_leaves_a_directory_the_next_start_finishes(checkpoint, tmp_path, kill):
    """Killed once the re-layout is committed, before its files are in place (0) or with the old ones
    moved out and the new ones not yet in (1): the next start finishes it, to the same bytes."""
    reference, directory = tmp_path / "reference", tmp_path / "ckpt"
    shutil.copytree(checkpoint / "ckpt", reference)
    shutil.copytree(checkpoint / "ckpt", directory)
    relayout_onto_one_plus_one(reference)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "CONVOY_CHECKPOINT_KILL": kill}
    killed = subprocess.run([sys.executable, "-c", _RELAYOUT, str(directory)], env=env, cwd=root, timeout=240)
    assert killed.returncode == -signal.SIGKILL
    relayout_onto_one_plus_one(directory)

    def files(path: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}

    assert files(directory) == files(reference)
    assert sorted(p.name for p in directory.glob("*.ckpt")) == ["model-rank0.ckpt", "model-rank1.ckpt",
                                                               "state-rank0.ckpt", "state-rank1.ckpt"]
