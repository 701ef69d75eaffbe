"""Resuming a checkpoint on another number of workers: the re-deal's exactness, the trajectory, refusals, crashes."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convoy.checkpoint.recovery import rank_file_tensors, restore_points, scan
from convoy.checkpoint.deal import _BLOCK, deal_mean, deal_states
from convoy.checkpoint.reshard import STAGING, Rebuild, complete, reshard
from convoy.checkpoint.written import rank_files, recorded_job
from convoy.checkpoint.store import Store
from convoy.cli.main import build_parser
from convoy.cli.train import config_from_args
from convoy.errors import UsageError
from convoy.train.elastic import job_record
from convoy.train.optim import optimizer_spec
from tests.checkpoint.elastic_helpers import assert_mean_kept, fingerprint, model_at
from tests.helpers import convoy_in_process, one_line_error, saved_model, seeded_model

# A constant learning rate: a cosine schedule over a shorter first run would differ from the whole run's.
LENET = ("--model", "lenet", "--batch-size", "12", "--seed", "6", "--no-progress", "--eval-every", "0",
         "--lr-schedule", "constant")
SPARSE = (*LENET, "--compress", "blocktopk", "--block-fraction", "0.05", "--checkpoint-full-every", "1")
# A full snapshot after the first step, then the log: a step between is reached by replaying records.
# Adam: the replayed optimizer has state (momentum correction would leave SGD without any).
LOGGED = (*LENET, "--compress", "blocktopk", "--block-fraction", "0.05", "--optimizer", "adam",
          "--checkpoint-full-every", "50")


def _train(nproc: int, steps: int, out: Path, checkpoints: Path | None, *job: str):
    extra = ("--checkpoint-dir", str(checkpoints)) if checkpoints is not None else ()
    done = convoy_in_process("train", "--nproc", str(nproc), *job, "--steps", str(steps), *extra, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return done


def _sync_state(directory: Path, world: int, step: int) -> list[dict[str, torch.Tensor]]:
    return [rank_file_tensors(directory / f"state-rank{r}.ckpt", "sync", step) for r in range(world)]


def _additive(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if k.split(".", 1)[0] in ("residual", "velocity")]


# ------------------------------------------------------------------ the deal itself
@pytest.mark.parametrize("old, new", [(4, 3), (4, 2), (2, 4), (4, 6), (4, 5), (8, 3)])
def test_the_deal_keeps_the_mean_over_workers_bit_for_bit(old, new):
    generator = torch.Generator().manual_seed(old * 10 + new)
    # Residual-like values: mostly within a few binary orders of each other, some exact zeros (sent blocks).
    parts = [torch.randn(5000, generator=generator) * 10 ** torch.randint(-3, 1, (5000,), generator=generator)
             for _ in range(old)]
    parts[0][:500] = 0.0
    dealt, inexact = deal_mean(parts, new)
    assert inexact == 0 and len(dealt) == new and all(t.dtype == torch.float32 for t in dealt)
    assert_mean_kept(parts, dealt)


def test_a_tensor_dealt_block_by_block_keeps_its_shape_and_every_element_s_mean():
    # Over several of deal_mean's blocks, the last one partial, in a 2-d residual: no element lost at a seam.
    generator = torch.Generator().manual_seed(5)
    shape = (3, _BLOCK + 11)
    parts = [torch.randn(shape, generator=generator) * 10 ** torch.randint(-3, 1, shape, generator=generator)
             for _ in range(4)]
    parts[1][1, _BLOCK - 3:_BLOCK + 3] = 0.0
    dealt, inexact = deal_mean(parts, 3)
    assert inexact == 0 and all(t.shape == shape and t.dtype == torch.float32 for t in dealt)
    assert_mean_kept(parts, dealt)
    # Where the tail does not fit one float32 the greedy expansion is used, across the seam too.
    parts[2][0, _BLOCK - 1:_BLOCK + 1] = 2.0 ** -40
    parts[0][0, _BLOCK - 1:_BLOCK + 1] = 1.0
    dealt, inexact = deal_mean(parts, 3)
    assert inexact == 0
    assert_mean_kept(parts, dealt)


def test_one_worker_gets_the_mean_rounded_once_and_the_rounded_elements_are_counted():
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    (dealt,), inexact = deal_mean(parts, 1)
    exact = sum(p.double() for p in parts) / 4   # exact: four float32 values of similar size, then / 4
    assert torch.equal(dealt, exact.float()) and inexact == int((dealt.double() != exact).sum()) > 0


def test_values_too_far_apart_to_deal_exactly_are_counted_not_hidden():
    # 1, 2^-30 and 2^-60 on different ranks: their mean needs more bits than two float32 values
    # (or one float64) hold.
    parts = [torch.tensor([1.0, 3.0]), torch.tensor([2.0 ** -30, 5.0]), torch.tensor([2.0 ** -60, 1.0]),
             torch.tensor([0.0, 0.0])]
    dealt, inexact = deal_mean(parts, 2)
    assert inexact == 1
    assert sum(t[1].item() for t in dealt) / 2 == (3.0 + 5.0 + 1.0) / 4   # the other element is exact


def test_shared_and_per_rank_state_are_dealt_and_unknown_state_is_refused():
    q = torch.randn(6, 2)
    states = [{"sync.residual.0": torch.full((3,), float(r)), "sync.powersgd_q.0.0": q.clone(),
               "rng.torch": torch.full((4,), r, dtype=torch.uint8)} for r in range(3)]
    dealt, _ = deal_states(states, 4)
    assert all(torch.equal(s["sync.powersgd_q.0.0"], q) for s in dealt)
    assert [int(s["rng.torch"][0]) for s in dealt] == [0, 1, 2, 0]
    assert list(dealt[0]) == list(states[0])   # the rank file's layout, key for key
    with pytest.raises(UsageError, match="cannot re-deal"):
        deal_states([{"sync.mystery.0": torch.zeros(2)}] * 2, 3)


# ------------------------------------------------------------------ through convoy train
@pytest.fixture(scope="module")
def sparse_checkpoint(tmp_path_factory):
    """A 4-worker blocktopk job (momentum correction: residuals and velocities) checkpointed at step 30."""
    tmp = tmp_path_factory.mktemp("sparse")
    _train(4, 30, tmp / "run", tmp / "ckpt", *SPARSE)
    return tmp / "ckpt", _sync_state(tmp / "ckpt", 4, 30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [3, 2])
def test_a_blocktopk_job_continued_on_fewer_workers_keeps_its_residuals_and_velocities(sparse_checkpoint, tmp_path,
                                                                                        world):
    checkpoint, before = sparse_checkpoint
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    done = _train(world, 31, tmp_path / "run", directory, *SPARSE)
    assert f"written by 4 workers; resuming on {world}: global batch 48 kept ({48 // world} per worker)" \
        in done.stderr
    assert "resumed from" in done.stderr and "at step 30" in done.stderr
    # The directory describes one job: this world's rank files, the old ones and the staging gone.
    assert sorted(rank_files(directory)) == list(range(world)) and not (directory / STAGING).exists()
    after = _sync_state(directory, world, 30)   # the re-dealt area, beside the one of step 31
    keys = _additive(before[0])
    assert {k.split(".")[0] for k in keys} == {"residual", "velocity"}
    for key in keys:
        assert_mean_kept([s[key] for s in before], [s[key] for s in after])
    shown = convoy_in_process("checkpoint", "inspect", str(directory))
    assert shown.returncode == 0 and f"written by {world} workers, global batch 48" in shown.stdout
    exported = convoy_in_process("checkpoint", "export", str(directory), str(tmp_path / "model.pt"))
    assert exported.returncode == 0 and torch.load(tmp_path / "model.pt")["step"] == 31
    # A third resume, on yet another world, works from what the second one left.
    done = _train(4, 32, tmp_path / "run3", directory, *SPARSE)
    assert f"written by {world} workers; resuming on 4" in done.stderr and "at step 31" in done.stderr


@pytest.mark.timeout(600)
def test_powersgd_state_is_dealt_its_shared_q_copied(tmp_path):
    job = (*LENET, "--compress", "powersgd")
    _train(4, 5, tmp_path / "a", tmp_path / "ckpt", *job)
    before = _sync_state(tmp_path / "ckpt", 4, 5)
    _train(3, 6, tmp_path / "b", tmp_path / "ckpt", *job)
    after = _sync_state(tmp_path / "ckpt", 3, 5)
    shared = [k for k in before[0] if k.startswith("powersgd_q.")]
    assert shared and _additive(before[0])
    for key in shared:   # every rank kept the same all-reduced Q, and every new rank gets it
        assert all(torch.equal(s[key], before[0][key]) for s in before + after), key
    for key in _additive(before[0]):
        assert_mean_kept([s[key] for s in before], [s[key] for s in after])


@pytest.mark.timeout(600)
def test_a_dense_job_continued_on_two_workers_ends_where_the_uninterrupted_four_worker_run_does(tmp_path):
    # Then restarted on two again with the first command's --batch-size, as torchrun restarts a job
    # it re-formed smaller: the checkpoint's global batch still holds.
    _train(4, 15, tmp_path / "whole", None, *LENET)
    _train(4, 5, tmp_path / "a", tmp_path / "ckpt", *LENET)
    done = _train(2, 10, tmp_path / "b", tmp_path / "ckpt", *LENET)
    assert "global batch 48 kept (24 per worker)" in done.stderr
    again = _train(2, 15, tmp_path / "c", tmp_path / "ckpt", *LENET)
    assert "trained with a global batch of 48: kept (24 per worker, not --batch-size 12)" in again.stderr
    assert "at step 10 (epoch 0, batch 10)" in again.stderr
    whole, resumed = saved_model(tmp_path / "whole"), saved_model(tmp_path / "c")
    worst = max((whole[k] - resumed[k]).abs().max().item() for k in whole)
    assert worst < 1e-5


# ------------------------------------------------------------------ bad input, crashes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc, extra, expected", [
    (5, (), "global batch of 48 does not divide over 5 workers"),
    (2, ("--sync", "hierarchical", "--clusters", "1"),
     "was written by a `--sync allreduce --parallel data` job, not `--sync hierarchical --parallel data`"),
    (2, ("--model", "vgg_fc"), "holds a checkpoint of a different model"),
])
def test_a_resume_that_cannot_be_mapped_is_refused_in_one_line_and_changes_nothing(sparse_checkpoint, tmp_path,
                                                                                   nproc, extra, expected):
    directory = tmp_path / "ckpt"
    shutil.copytree(sparse_checkpoint[0], directory)
    before = fingerprint(directory)
    line = one_line_error(convoy_in_process("train", "--nproc", str(nproc), *SPARSE, *extra, "--steps", "31",
                                            "--checkpoint-dir", str(directory), "--out", str(tmp_path / "run")))
    assert expected in line
    assert fingerprint(directory) == before


def _rebuild(job: tuple[str, ...]) -> Rebuild:
    """What ``convoy train --nproc 3`` of ``job`` gives the re-deal to write the step as a full snapshot
    (convoy.train.elastic.remap_ranks)."""
    config = config_from_args(build_parser().parse_args(["train", *job]))
    optimizer_class, hyper = optimizer_spec(config)
    return Rebuild(seeded_model("lenet"), optimizer_class, hyper, job_record(config, 3, 48))


def _start_on_three(directory: Path, job: tuple[str, ...] | None = None) -> None:
    """What a start on 3 workers does to the directory (convoy.train.elastic): finish a committed
    re-deal, else re-deal (``job``: the model file's step written as a full snapshot, as ``convoy
    train`` of that job does; None: left in the log)."""
    complete(directory)
    found = recorded_job(directory)
    if found.world != 3:
        reshard(directory, found.world, 3, rebuild=None if job is None else _rebuild(job))


_START_ON_THREE = ("import sys; from pathlib import Path; from tests.checkpoint.test_reshard import _start_on_three; "
                   "_start_on_three(Path(sys.argv[1]), tuple(sys.argv[2:]) or None)")


def _killed_start_on_three(directory: Path, kill: str, job: tuple[str, ...] = ()) -> int:
    """:func:`_start_on_three` in a fresh interpreter that the kill point ``kill`` SIGKILLs (a fork of
    this process could inherit a lock some thread of torch's holds); its return code."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "CONVOY_CHECKPOINT_KILL": kill}
    return subprocess.run([sys.executable, "-c", _START_ON_THREE, str(directory), *job], env=env, cwd=root,
                          timeout=240).returncode


def _two_copies(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of ``checkpoint``: one re-dealt without a kill (the reference), one with."""
    reference, directory = tmp_path / "reference", tmp_path / "ckpt"
    shutil.copytree(checkpoint, reference)
    shutil.copytree(checkpoint, directory)
    return reference, directory


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", ["record:{generation}", "reshard:0", "reshard:1"])
def test_a_kill_during_the_re_deal_leaves_a_directory_that_resumes_to_the_same_state(sparse_checkpoint, tmp_path,
                                                                                      kill):
    checkpoint, before = sparse_checkpoint
    reference, directory = _two_copies(checkpoint, tmp_path)
    _start_on_three(reference)
    store = Store.open(checkpoint / "state-rank0.ckpt")
    try:   # the re-dealt files are committed with the generation rank 0's file has at step 30
        generation = max(r.record.generation for r in scan(store) if r.valid)
    finally:
        store.close()
    assert _killed_start_on_three(directory, kill.format(generation=generation)) == -signal.SIGKILL
    # Whatever the kill left, the next start finishes or redoes the re-deal: the same state as without it.
    _start_on_three(directory)
    assert sorted(rank_files(directory)) == [0, 1, 2]
    for mine, theirs in zip(_sync_state(directory, 3, 30), _sync_state(reference, 3, 30)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.timeout(600)
def test_the_nodes_copies_of_the_model_file_follow_the_new_world(sparse_checkpoint, tmp_path):
    """A directory two nodes share (torchrun, 2 workers a node): writers 0 and 2 each kept the model."""
    checkpoint, _ = sparse_checkpoint
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    models = sorted(p.name for p in directory.glob("model-rank0.ckpt*"))
    for name in models:
        shutil.copyfile(directory / name, directory / name.replace("rank0", "rank2"))
    # Down to one node: the other node's copy goes aside with the old rank files.
    reshard(directory, 4, 2, writers=[0])
    assert sorted(p.name for p in directory.glob("model-rank*")) == models
    assert (directory / STAGING / "old" / "model-rank2.ckpt").exists()
    # Back to two nodes: the new node's writer gets rank 0's model file and its log, byte for byte.
    reshard(directory, 2, 4, writers=[0, 2])
    for name in models:
        copy = directory / name.replace("rank0", "rank2")
        assert copy.read_bytes() == (directory / name).read_bytes(), name


# ------------------------------------------------------------------ a step inside the model file's log
@pytest.fixture(scope="module")
def logged_checkpoint(tmp_path_factory):
    """A 4-worker job at step 20, its model file a full snapshot of step 1 and the log of 19 steps after
    it; and the same job checkpointed with a full snapshot at every step (the reference)."""
    tmp = tmp_path_factory.mktemp("logged")
    _train(4, 20, tmp / "run", tmp / "ckpt", *LOGGED)
    full = [*LOGGED[:-1], "1"]
    _train(4, 20, tmp / "full-run", tmp / "full", *full)
    return tmp / "ckpt", tmp / "full"


def _snapshot_of(path: Path) -> tuple[int, int]:
    """The newest step ``path`` can restore, and the step of the full snapshot that step extends."""
    store = Store.open(path)
    try:
        points = restore_points(path, scan(store))
    finally:
        store.close()
    return max(points), points[max(points)].report.record.step


def _assert_same_model(path: Path, reference: Path, step: int) -> None:
    """The parameters and optimizer state of ``path``'s full snapshot of ``step`` are ``reference``'s, bit for bit."""
    params, states, _ = model_at(path, step)
    want_params, want_states, _ = model_at(reference, step)
    assert params.keys() == want_params.keys() and all(torch.equal(params[k], want_params[k]) for k in params)
    assert states.keys() == want_states.keys()
    for layer, state in states.items():
        assert state.keys() == want_states[layer].keys(), layer
        for index, values in state.items():
            want = want_states[layer][index]
            assert values.keys() == want.keys() and values.keys(), (layer, index)
            assert all(torch.equal(values[k], want[k]) if isinstance(want[k], torch.Tensor) else values[k] == want[k]
                       for k in want), (layer, index)


@pytest.mark.timeout(600)
def test_a_re_deal_inside_the_log_writes_the_step_as_the_snapshot_the_uninterrupted_run_took(logged_checkpoint,
                                                                                                tmp_path):
    checkpoint, full = logged_checkpoint
    assert _snapshot_of(checkpoint / "model-rank0.ckpt") == (20, 1)   # step 20 lies in the log
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    done = _train(3, 20, tmp_path / "run", directory, *LOGGED)
    assert "per-rank state re-dealt at step 20" in done.stderr, done.stderr
    # Every new rank restored a full snapshot: no log applied.
    assert "resumed from" in done.stderr and "at step 20 (epoch 0, batch 20)" in done.stderr, done.stderr
    assert "differential steps replayed" not in done.stderr, done.stderr
    path = directory / "model-rank0.ckpt"
    assert _snapshot_of(path) == (20, 20) and not any(directory.glob("model-rank0.ckpt.diff*"))
    # What the re-deal wrote is what the run that took a full snapshot at step 20 holds, bit for bit.
    _assert_same_model(path, full / "model-rank0.ckpt", 20)
    assert recorded_job(directory).world == 3
    # And it goes on: a step on 3 workers, then back on 4.
    done = _train(3, 21, tmp_path / "run2", directory, *LOGGED)
    assert "at step 20" in done.stderr and "written by" not in done.stderr
    done = _train(4, 22, tmp_path / "run3", directory, *LOGGED)
    assert "written by 3 workers; resuming on 4" in done.stderr and "at step 21" in done.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", ["slot:{generation}:1", "record:{generation}", "reshard:0", "reshard:1"])
def test_a_kill_while_the_snapshot_is_written_or_moved_in_leaves_a_usable_directory(logged_checkpoint, tmp_path,
                                                                                       kill):
    checkpoint, _ = logged_checkpoint
    reference, directory = _two_copies(checkpoint, tmp_path)
    _start_on_three(reference, LOGGED)
    store = Store.open(checkpoint / "model-rank0.ckpt")
    try:   # the new snapshot is the generation after the one step 20 extends (the newest)
        generation = max(r.record.generation for r in scan(store) if r.valid) + 1
    finally:
        store.close()
    assert _killed_start_on_three(directory, kill.format(generation=generation), LOGGED) == -signal.SIGKILL
    if kill.startswith(("slot", "record")):
        # Killed before the re-deal committed: the old job's files are untouched, for 4 workers to go on.
        assert {k: v for k, v in fingerprint(directory).items() if not k.startswith(STAGING)} == \
            fingerprint(checkpoint)
    # Whatever the kill left, the next start finishes or redoes the re-deal: the same state as without it.
    _start_on_three(directory, LOGGED)
    assert sorted(rank_files(directory)) == [0, 1, 2]
    _assert_same_model(directory / "model-rank0.ckpt", reference / "model-rank0.ckpt", 20)
    for mine, theirs in zip(_sync_state(directory, 3, 20), _sync_state(reference, 3, 20)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.timeout(300)
def test_the_nodes_copies_of_a_rebuilt_model_file_are_the_new_snapshot(logged_checkpoint, tmp_path):
    """Two nodes share the directory (writers 0 and 2): the old copy, log and all, goes aside; the new
    node's writer gets rank 0's new file, the step as a full snapshot and no log."""
    checkpoint, full = logged_checkpoint
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    for path in sorted(directory.glob("model-rank0.ckpt*")):
        shutil.copyfile(path, directory / path.name.replace("rank0", "rank2"))
    reshard(directory, 4, 3, writers=[0, 2], rebuild=_rebuild(LOGGED))
    assert sorted(p.name for p in directory.glob("model-rank*")) == ["model-rank0.ckpt", "model-rank2.ckpt"]
    assert (directory / "model-rank2.ckpt").read_bytes() == (directory / "model-rank0.ckpt").read_bytes()
    assert (directory / STAGING / "old" / "model-rank2.ckpt.diffB").exists()
    _assert_same_model(directory / "model-rank2.ckpt", full / "model-rank0.ckpt", 20)
