"""Resuming a data-parallel job on another number of workers: re-deal the per-rank state.

A checkpoint of ``N`` workers holds one model file (the same on every rank)
and ``N`` rank files: each rank's error-feedback residuals, momentum-correction
velocities, PowerSGD warm start, buffers and RNG. To go on with ``M`` workers,
:func:`reshard` writes ``M`` new rank files from the ``N`` old ones and puts
them in their place, so the directory again describes one job and the usual
resume reads it. What the deal keeps, and how exactly: :mod:`convoy.checkpoint.deal`.

Crash safety. The new files are written into ``.reshard/`` and made durable;
writing ``.reshard/plan.json`` commits the re-deal. Then (roll-forward,
idempotent, :func:`complete`) the model file's differential log past the
re-dealt step is cut (those steps were taken by the old workers; the new ones
train them again), the old rank files move to ``.reshard/old/`` and the new
ones into the directory. A kill before the plan leaves the old files as they
were; a kill after it is completed by the next start. ``.reshard/`` is removed
(:func:`cleanup`) once the new world has committed a step of its own.

Example::

    >>> job = recorded_job(Path("ckpt"))          # JobRecord(world=4, global_batch=48, ...)
    >>> reshard(Path("ckpt"), 3)                  # state-rank0..2.ckpt now hold the re-dealt state
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from convoy.checkpoint import faults
from convoy.checkpoint.deal import deal_states
from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.format import CommitRecord, FormatError, Layout
from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.recovery import restore_points, scan, valid_steps
from convoy.checkpoint.snapshot import rank_layout
from convoy.checkpoint.store import AREAS, Store
from convoy.errors import UsageError
from convoy.utils.atomic import sync_folder

STAGING = ".reshard"
PLAN = "plan.json"
DONE = "done"


@dataclass
class JobRecord:
    """What a checkpoint says of the job that wrote it: workers, global batch (None: not recorded)."""

    world: int
    global_batch: int | None
    model_files: int


@dataclass
class Deal:
    """The re-dealt rank states, the step they are of, and what the caller should be told."""

    states: list[dict[str, torch.Tensor]]
    step: int
    retrained: int        # logged steps after ``step`` that the new world trains again
    inexact: int          # elements whose mean could not be kept bit for bit (see the module's text)
    record: CommitRecord  # rank 0's record of ``step``: generation, epoch and position
    model_area: int       # the model file's area whose snapshot (of step ``model_base``) ``step`` extends
    model_generation: int
    model_base: int


def rank_files(directory: Path) -> dict[int, Path]:
    """The rank files in ``directory`` by rank."""
    out = {}
    for path in directory.glob("state-rank*.ckpt"):
        number = path.name[len("state-rank"):-len(".ckpt")]
        if number.isdigit():
            out[int(number)] = path
    return out


def recorded_job(directory: Path) -> JobRecord | None:
    """The world size and global batch of the newest committed checkpoint in ``directory``;
    None when it holds none. Checkpoints from before they were recorded: the number of rank
    files, and no global batch."""
    models = sorted(directory.glob("model-rank*.ckpt"))
    if not models:
        return None
    extra = _newest_extra(models[0])
    if extra is None:
        return None   # nothing committed (or damaged: the resume itself reports it)
    # The rank files say first: after a re-deal they are the new world's, the model file's
    # newest record still the old world's until the new one commits.
    own = _newest_extra(rank_file(directory, 0)) or {}
    world = own.get("world") or extra.get("world") or len(rank_files(directory))
    return JobRecord(int(world), extra.get("global_batch"), len(models))


def _newest_extra(path: Path) -> dict | None:
    """The ``extra`` of the newest valid record of ``path``; None: no such file or record."""
    try:
        store = Store.open(path)
    except (OSError, FormatError):
        return None
    try:
        records = sorted((r.record for r in scan(store, verify_all=False) if r.valid), key=lambda r: r.generation)
    finally:
        store.close()
    return records[-1].extra if records else None


# ------------------------------------------------------------------ on disk
def plan_deal(directory: Path, old_world: int, world: int) -> Deal:
    """Read the newest step that the model file can restore and every old rank file holds, and
    deal its rank states to ``world``. Reads only.

    Raises:
        UsageError: a rank file is missing or damaged, or no step is held by them all.
    """
    files = rank_files(directory)
    missing = [r for r in range(old_world) if r not in files]
    if missing:
        raise UsageError(f"{directory} lacks the rank files of ranks {missing} of the {old_world} workers that "
                         "wrote it (their per-rank state would be lost); resume on "
                         f"{old_world} workers, or pass --no-resume")
    extra = sorted(r for r in files if r >= old_world)
    if extra:
        raise UsageError(f"{directory} holds rank files of ranks {extra} beyond the {old_world} workers of its "
                         "newest checkpoint; it mixes two jobs (move the directory away, or pass --no-resume)")
    mpath = model_file(directory, 0)
    store = Store.open(mpath)
    try:
        reports = scan(store, verify_all=False)
    finally:
        store.close()
    points = restore_points(mpath, reports)
    # A step the model file reaches through its log counts too: a resume applies the logged updates
    # to the model (the rank files hold that step's state themselves, so nothing per rank is replayed).
    full = set(points)
    stores, reports_by_rank = [], []
    try:
        for rank in range(old_world):
            stores.append(Store.open(files[rank]))
            reports_by_rank.append(valid_steps(scan(stores[-1])))
            full &= set(reports_by_rank[-1])
        if not full:
            raise UsageError(f"no step of {directory} is held by the model file and all {old_world} rank files; "
                             "nothing was changed (move the directory away, or pass --no-resume)")
        step = max(full)
        states = []
        for rank, store in enumerate(stores):
            tensors = store.tensors(reports_by_rank[rank][step].area, 0)
            states.append({k: v.clone() for k, v in tensors.items()})
            del tensors
        records = [reports_by_rank[r][step].record for r in range(old_world)]
    except FormatError as exc:
        raise UsageError(f"{directory}: a rank file is damaged ({exc}); nothing was changed") from None
    finally:
        for store in stores:
            store.close()
    dealt, inexact = deal_states(states, world)
    report = points[step].report
    return Deal(dealt, step, max(points) - step, inexact, records[0], report.area, report.record.generation,
                report.record.step)


def reshard(directory: Path, old_world: int, world: int, writers: list[int] | tuple[int, ...] = (0,)) -> Deal:
    """Re-deal the rank files of ``old_world`` workers in ``directory`` to ``world`` and put
    the new ones in place (crash-safe: see the module's text). Run by one process while the
    others wait.

    ``writers``: the ranks of the new world that keep a model file here (each node's first,
    when several nodes share the directory); each gets a copy of rank 0's.

    Raises:
        UsageError: as :func:`plan_deal`; nothing is changed then.
    """
    complete(directory)
    staging = directory / STAGING
    if staging.exists():
        shutil.rmtree(staging)   # an earlier re-deal's backup (done), or one that never committed its plan
    deal = plan_deal(directory, old_world, world)
    staging.mkdir()
    record = deal.record
    for rank, state in enumerate(deal.states):
        _write_rank_file(staging / rank_file(directory, rank).name, state, rank, world, record)
    sync_folder(staging)
    plan = {"from": old_world, "to": world, "step": deal.step, "model_area": deal.model_area,
            "model_generation": deal.model_generation, "model_base": deal.model_base,
            "writers": sorted(set(writers) - {0})}
    tmp = staging / (PLAN + ".tmp")
    with open(tmp, "w") as f:
        json.dump(plan, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / PLAN)   # the commit point of the re-deal
    sync_folder(staging)
    faults.halfway("reshard", 0)      # a crash test's kill point: committed, not yet in place
    complete(directory)
    return deal


def _write_rank_file(path: Path, state: dict[str, torch.Tensor], rank: int, world: int,
                     record: CommitRecord) -> None:
    layout: Layout = rank_layout(state, {"rank": rank, "checksum": "pagesum"})
    store = Store.create(path, layout)
    try:
        area = record.generation % AREAS
        store.invalidate(area)
        checksum = store.write_tensors(area, 0, [state[spec.key] for spec in layout.slots[0].tensors],
                                       record.generation)
        store.flush(area)
        store.commit(area, CommitRecord(record.generation, record.step, record.epoch, record.position, [checksum],
                                        {"rank": rank, "world": world}))
    finally:
        store.close()


def complete(directory: Path) -> bool:
    """Finish a committed re-deal (idempotent: a kill anywhere in it is finished by the next call).
    Returns whether one was finished."""
    staging = directory / STAGING
    plan_path = staging / PLAN
    if not plan_path.exists() or (staging / DONE).exists():
        return False
    plan = json.loads(plan_path.read_text())
    old_world, world, step = plan["from"], plan["to"], plan["step"]
    # The old workers' log past the re-dealt step: replaying it on the new workers' state would not
    # give the state they would have had; they train those steps again.
    log = log_path(model_file(directory, 0), plan["model_area"])
    if log.exists():
        DiffLog.reopen(log, plan["model_generation"], plan["model_base"], step).close()
    old = staging / "old"
    old.mkdir(exist_ok=True)
    for rank in range(old_world):
        path, new = rank_file(directory, rank), staging / rank_file(directory, rank).name
        if path.exists() and (rank >= world or new.exists()):
            os.replace(path, old / path.name)
    # The other nodes' model files (a directory several nodes share) are copies of rank 0's, of
    # the old world's steps: they go too, and each writer of the new world gets rank 0's, log cut.
    for path in _model_copies(directory):
        os.replace(path, old / path.name)
    sync_folder(old)
    faults.halfway("reshard", 1)   # a crash test's kill point: the old files out, the new ones not in
    source = model_file(directory, 0)
    for writer in plan.get("writers", []):
        for path in [source, *sorted(directory.glob(source.name + ".diff*"))]:
            copy = staging / (model_file(directory, writer).name + path.name[len(source.name):])
            shutil.copyfile(path, copy)
            with open(copy, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(copy, directory / copy.name)
    for rank in range(world):
        new = staging / rank_file(directory, rank).name
        if new.exists():
            os.replace(new, rank_file(directory, rank))
    sync_folder(directory)
    (staging / DONE).touch()
    sync_folder(staging)
    return True


def _model_copies(directory: Path) -> list[Path]:
    """The model files (and their logs) of writers other than rank 0."""
    own = model_file(directory, 0).name
    return sorted(p for p in directory.glob("model-rank*.ckpt*") if not p.name.startswith(own))


def cleanup(directory: Path) -> None:
    """Remove a finished re-deal's backup of the old rank files once every rank file has
    committed a step after the re-dealt one (the new world's own checkpoint)."""
    staging = directory / STAGING
    if not (staging / DONE).exists():
        return
    step = json.loads((staging / PLAN).read_text())["step"]
    for path in rank_files(directory).values():
        try:
            store = Store.open(path)
        except (OSError, FormatError):
            return
        try:
            if max(valid_steps(scan(store, verify_all=False)), default=-1) <= step:
                return
        finally:
            store.close()
    shutil.rmtree(staging)
