"""Resuming a data-parallel job on another number of workers: re-deal the per-rank state.

A checkpoint of ``N`` workers holds one model file (the same on every rank)
and ``N`` rank files: each rank's error-feedback residuals, momentum-correction
velocities, PowerSGD warm start, buffers and RNG. To go on with ``M`` workers,
:func:`reshard` writes ``M`` new rank files from the ``N`` old ones and puts
them in their place, so the directory again describes one job and the usual
resume reads it. What the deal keeps, and how exactly: :mod:`convoy.checkpoint.deal`.

The model file. When the re-dealt step lies in the model file's differential
log (a full snapshot, then the sparse updates of the steps after it), every new
rank would restore the snapshot and apply the log. Given a :class:`Rebuild`,
rank 0, which reads the log here anyway, does that once and stages a new model
file holding the step as a full snapshot
(:func:`convoy.checkpoint.relayout.snapshot_model_file`): the new ranks restore
it with no log to apply. The old file and its logs go aside with the old rank
files. (Writing the snapshot into the live file's other area instead would
change the old checkpoint before the re-deal commits: a resume on the old
world would then restore it and go on in that area's log while the older
area's log still held the old run's steps past it, which
:func:`convoy.checkpoint.recovery.restore_points` prefers for those steps.)

Crash safety. The new files are written into ``.reshard/`` and made durable;
writing ``.reshard/plan.json`` commits the re-deal. Then (roll-forward,
idempotent, :func:`complete`) the model file's differential log past the
re-dealt step is cut (those steps were taken by the old workers; the new ones
train them again) or the model file replaced by the staged one, the old rank
files move to ``.reshard/old/`` and the new ones into the directory. A kill
before the plan leaves the old files as they were; a kill after it is
completed by the next start. ``.reshard/`` is removed (:func:`cleanup`) once
the new world has committed a step of its own.

Example::

    >>> job = recorded_job(Path("ckpt"))          # convoy.checkpoint.written: JobRecord(world=4, ...)
    >>> reshard(Path("ckpt"), job.world, 3)                  # state-rank0..2.ckpt now hold the re-dealt state
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.checkpoint import faults
from convoy.checkpoint.deal import deal_states
from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.format import CommitRecord, FormatError, Layout
from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.recovery import scan, valid_steps
from convoy.checkpoint.relayout import old_files, snapshot_model_file
from convoy.checkpoint.snapshot import rank_layout
from convoy.checkpoint.store import AREAS, Store
from convoy.checkpoint.written import ModelPart, rank_files, read_job
from convoy.utils.atomic import sync_folder

STAGING = ".reshard"
PLAN = "plan.json"
DONE = "done"


@dataclass
class Deal:
    """The re-dealt rank states, the step they are of, and what the caller should be told."""

    states: list[dict[str, torch.Tensor]]
    step: int
    retrained: int        # logged steps after ``step`` that the new world trains again
    inexact: int          # elements whose mean could not be kept bit for bit (see the module's text)
    record: CommitRecord  # rank 0's record of ``step``: generation, epoch and position
    model: ModelPart      # rank 0's model file at ``step``: the snapshot it extends, and the log records after it


@dataclass(frozen=True)
class Rebuild:
    """What rank 0 needs to write the model file's state at the re-dealt step as a full snapshot
    (see the module's text).

    Args:
        model: a model of the checkpoint's layout; its parameters are overwritten (the resume
            that follows restores them).
        optimizer_class: the optimizer the log's records are replayed through.
        optimizer_kwargs: its hyper-parameters, as the new job builds it.
        job: what the new model file's record says of the job (``world``, ``global_batch``, ``layout``).
    """

    model: nn.Module
    optimizer_class: type
    optimizer_kwargs: dict[str, Any]
    job: dict[str, Any]


# ------------------------------------------------------------------ on disk
def plan_deal(directory: Path, old_world: int, world: int) -> Deal:
    """Read the newest step that the model file can restore and every old rank file holds, and
    deal its rank states to ``world``. Reads only.

    Raises:
        UsageError: a rank file is missing or damaged, or no step is held by them all.
    """
    job = read_job(directory, old_world, [model_file(directory, 0).name])
    dealt, inexact = deal_states(job.states, world)
    return Deal(dealt, job.step, job.retrained, inexact, job.record, job.models[model_file(directory, 0).name])


def reshard(directory: Path, old_world: int, world: int, writers: list[int] | tuple[int, ...] = (0,),
            rebuild: Rebuild | None = None) -> Deal:
    """Re-deal the rank files of ``old_world`` workers in ``directory`` to ``world`` and put
    the new ones in place (crash-safe: see the module's text). Run by one process while the
    others wait.

    Args:
        directory: the checkpoint directory.
        old_world: the workers that wrote it.
        world: the workers that go on.
        writers: the ranks of the new world that keep a model file here (each node's first,
            when several nodes share the directory); each gets a copy of rank 0's.
        rebuild: where the step lies in the model file's log, write the model file's state at it
            as a full snapshot (None: the new ranks apply the log themselves).

    Raises:
        UsageError: as :func:`plan_deal`, or the step cannot be rebuilt; nothing is changed then.
    """
    complete(directory)
    deal = plan_deal(directory, old_world, world)
    commit_deal(directory, deal, old_world, writers, rebuild)
    return deal


def commit_deal(directory: Path, deal: Deal, old_world: int, writers: list[int] | tuple[int, ...] = (0,),
                rebuild: Rebuild | None = None) -> None:
    """Stage the re-deal :func:`plan_deal` planned (and, given ``rebuild``, the model file's step as a
    full snapshot), commit it and put it in place: the second half of :func:`reshard`, whose
    arguments these are, for a caller that checks something between the two.

    Raises:
        UsageError: the step cannot be rebuilt; nothing is changed then.
    """
    world = len(deal.states)
    staging = fresh_staging(directory)
    plan: dict[str, Any] = {"from": old_world, "to": world, "step": deal.step, "writers": sorted(set(writers) - {0})}
    point = deal.model.point
    if rebuild is not None and point.updates:
        name = model_file(directory, 0).name
        put = snapshot_model_file(deal.model, staging / name, rebuild.model, rebuild.optimizer_class,
                                  rebuild.optimizer_kwargs, deal.record, rebuild.job)
        plan.update({"put": put, "retire": old_files(directory)})   # the other writers' copies go too
    else:
        plan.update({"model_area": point.report.area, "model_generation": point.report.record.generation,
                     "model_base": point.report.record.step})
    for rank, state in enumerate(deal.states):
        write_rank_file(staging / rank_file(directory, rank).name, state, rank, deal.record, {"world": world})
    commit_plan(directory, plan)


def fresh_staging(directory: Path) -> Path:
    """An empty ``.reshard/`` to stage new files in (an earlier re-deal's backup, done, or one
    that never committed its plan, is removed)."""
    staging = directory / STAGING
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def commit_plan(directory: Path, plan: dict[str, Any]) -> None:
    """Commit the re-deal staged in ``.reshard/`` (its files made durable, then the plan written:
    the commit point) and put it in place (:func:`complete`).

    ``plan``: ``from``, ``to`` (the worlds), ``step``; for a data-parallel re-deal the ``writers``
    that get a copy of rank 0's model file and either that file's area, generation and base
    step (its log is cut past ``step``) or, as for a re-layout, ``put`` (the staged model and
    other files to move in) and ``retire`` (the old files to move aside).
    """
    staging = directory / STAGING
    for path in (p for p in staging.iterdir() if p.is_file()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    sync_folder(staging)
    tmp = staging / (PLAN + ".tmp")
    with open(tmp, "w") as f:
        json.dump(plan, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / PLAN)   # the commit point of the re-deal
    sync_folder(staging)
    faults.halfway("reshard", 0)      # a crash test's kill point: committed, not yet in place
    complete(directory)


def write_rank_file(path: Path, state: dict[str, torch.Tensor], rank: int, record: CommitRecord,
                    job: dict[str, Any]) -> None:
    """A rank file holding ``state``, committed as ``record``'s step of the job ``job`` describes
    (``world``, and what else the records say of it)."""
    layout: Layout = rank_layout(state, {"rank": rank, "checksum": "pagesum"})
    store = Store.create(path, layout)
    try:
        area = record.generation % AREAS
        store.invalidate(area)
        checksum = store.write_tensors(area, 0, [state[spec.key] for spec in layout.slots[0].tensors],
                                       record.generation)
        store.flush(area)
        store.commit(area, CommitRecord(record.generation, record.step, record.epoch, record.position, [checksum],
                                        {"rank": rank, **job}))
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
    put = plan.get("put")   # a re-layout: its model files are staged whole (their logs already cut)
    if put is None:
        # The old workers' log past the re-dealt step: replaying it on the new workers' state would not
        # give the state they would have had; they train those steps again.
        # Only the records' heads are read: those up to the step were checked when it was chosen, and
        # a record damaged since ends the chain a resume reads all the same.
        log = log_path(model_file(directory, 0), plan["model_area"])
        if log.exists():
            DiffLog.reopen(log, plan["model_generation"], plan["model_base"], step, verify=False).close()
    old = staging / "old"
    old.mkdir(exist_ok=True)
    for rank in range(old_world):
        path, new = rank_file(directory, rank), staging / rank_file(directory, rank).name
        if path.exists() and (rank >= world or new.exists()):
            os.replace(path, old / path.name)
    # The other nodes' model files (a directory several nodes share) are copies of rank 0's, of
    # the old world's steps: they go too, and each writer of the new world gets rank 0's, log cut.
    # A re-layout names the old files it replaces; one already replaced (its new file moved in) stays.
    retired = _model_copies(directory) if put is None else \
        [directory / name for name in plan["retire"] if (staging / name).exists() or name not in put]
    for path in retired:
        if path.exists():
            os.replace(path, old / path.name)
    sync_folder(old)
    faults.halfway("reshard", 1)   # a crash test's kill point: the old files out, the new ones not in
    for name in put or []:   # before the writers' copies: a staged model file of rank 0 is what they copy
        if (staging / name).exists():
            os.replace(staging / name, directory / name)
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
