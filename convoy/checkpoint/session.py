"""Checkpointing for one training job: check the directory, resume if asked, attach the listener.

``start_checkpointing`` runs on every rank before training. Each rank scans
the model file of its node's writer and its own rank file; the ranks agree on
the newest step valid in all of them (one small all-gather), restore it, and
the writer reopens its file to write the next generation into the other area.

Example::

    >>> session = start_checkpointing(CheckpointSettings("ckpt", every=1), model, engine,
    ...                               torch.optim.SGD, {"lr": 0.05}, total_steps=100, steps_per_epoch=50)
    >>> session.start.step        # 0 for a fresh run, else the step resumed from
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn

from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.format import FormatError, Layout
from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.listener import CheckpointedEngine, CheckpointListener
from convoy.checkpoint.persister import CheckpointFiles
from convoy.checkpoint.recovery import (AreaReport, RestorePoint, fallback_notes, read_updates, replay_updates,
                                       restore_model, restore_points, restore_rank, scan, valid_steps)
from convoy.checkpoint.replay import ReplayFeed
from convoy.checkpoint.schedule import DEFAULT_BUDGET, DEFAULT_FULL_EVERY, DEFAULT_RANK_FILES, RANK_FILES
from convoy.checkpoint.snapshot import model_layout, rank_layout, rank_state
from convoy.checkpoint.store import AREAS, Store
from convoy.compress import FP16Compressor, IdentityCompressor
from convoy.core import SyncStrategy
from convoy.errors import UsageError
from convoy.sync.allreduce import AllReduce


@dataclass
class CheckpointSettings:
    """Where and how often to checkpoint; ``resume`` None means "if the directory holds a checkpoint".

    ``every`` is a number of steps or ``"auto"`` (as often as ``budget``, a share
    of the step time, allows); ``full_every``: with a sparse gradient compressor,
    a full snapshot every this many checkpoints and the exchanged update in between,
    or ``"auto"`` (as seldom as ``budget`` needs, measured; 10 to 100 checkpoints).
    ``rank_files``: where a resume could rebuild the ranks' own files by replay, whether they are
    written at ``"every"`` checkpoint or only with the ``"full"`` snapshots
    (:data:`~convoy.checkpoint.schedule.RANK_FILES`).
    """

    directory: str
    every: int | str = 1
    resume: bool | None = None
    timeout_s: float = 300.0
    budget: float = DEFAULT_BUDGET
    full_every: int | str = DEFAULT_FULL_EVERY
    # What the commit records say of the job ({"world": workers, "global_batch": samples a step,
    # "layout": its sync and parallel layout}): a resume on another number of workers keeps the
    # global batch and maps the layout's state (convoy.train.elastic).
    job: dict[str, Any] = field(default_factory=dict)
    rank_files: str = DEFAULT_RANK_FILES

    def __post_init__(self) -> None:
        if self.rank_files not in RANK_FILES:
            raise ValueError(f"rank_files must be one of {', '.join(RANK_FILES)}, got {self.rank_files!r}")


@dataclass
class ResumePoint:
    """Where training goes on: steps done, the epoch and the batch within it.

    ``replay_to``: the steps from ``step`` up to this one are replayed (the
    sync strategy takes their averaged gradients from the checkpoint's log and
    the checkpoints stay quiet), so the training loop simply starts at ``step``.
    """

    step: int = 0
    epoch: int = 0
    position: int = 0
    notes: list[str] = field(default_factory=list)
    replay_to: int | None = None

    @property
    def reached(self) -> int:
        """The newest step the checkpoint holds: where training is once the replay is over."""
        return self.step if self.replay_to is None else self.replay_to


@dataclass
class CheckpointSession:
    listener: CheckpointListener
    start: ResumePoint


def check_directory(directory: str) -> Path:
    """Create ``directory`` if needed; UsageError when it is a file or not writable."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--checkpoint-dir {directory} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {directory} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--checkpoint-dir {directory} is not writable")
    return path


def _topology(group_ranks: list[int] | None) -> tuple[int, int, list[int]]:
    """(rank, world size, the ranks on this node that hold the same layers as this one).

    The first of those ranks is the writer of their model file.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Without torchrun's LOCAL_* variables (a hand-made group) every rank is on this node.
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = range(rank - local_rank, rank - local_rank + local_world)
    peers = [r for r in node if group_ranks is None or r in group_ranks]
    return rank, world, peers


def _open_reports(path: Path, signature: str | None, layout: Layout | None) -> list[AreaReport] | None:
    """Scan ``path``; None when it does not exist. A different model's file is a UsageError."""
    if not path.exists():
        return None
    try:
        store = Store.open(path)
    except FormatError as exc:
        raise UsageError(f"{path} is not a usable checkpoint: {exc}; nothing was overwritten") from None
    try:
        if layout is not None:
            mismatch = layout.first_mismatch(store.layout)
            if mismatch:
                raise UsageError(f"{path} holds a checkpoint of a different model: {mismatch} "
                                 "(use another --checkpoint-dir, or --no-resume to overwrite it)")
        return scan(store, signature, verify_all=False)
    finally:
        store.close()


def _other_writers_here(writer: int, writers: list[int]) -> list[int]:
    """The writers of the other model files in this node's directory (hybrid groups, colocated
    shards, hierarchical ranks): each writer keeps within one checkpoint of them, so that the
    files always share a step to resume from (each keeps only two)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    node = range(rank - local_rank, rank - local_rank + int(os.environ.get("LOCAL_WORLD_SIZE", len(writers))))
    return sorted({w for w in writers if w != writer and w in node})


def _remote_writers(writer: int, writers: list[int]) -> dict[str, Any]:
    """The writers of model files on other machines, and the job's store their steps travel through
    (torchrun on several hosts: a directory per machine, and the files of one cannot see another's)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    node = range(rank - local_rank, rank - local_rank + int(os.environ.get("LOCAL_WORLD_SIZE", len(writers))))
    remote = sorted({w for w in writers if w != writer and w not in node})
    if not remote:
        return {}
    return {"remote_writers": remote, "peer_store": dist.distributed_c10d._get_default_store()}


class _Holding(NamedTuple):
    """What one rank's files hold, gathered on every rank to agree where the job resumes."""

    found: bool                    # any committed area at all
    steps: list[int]               # steps its model and rank files can both restore
    replayable: list[int]          # steps reached by replaying a snapshot's log
    writer: int                    # the rank that writes its model file
    first_commit_only: bool        # every committed area is its file's first commit


def _gather(value: Any, world: int) -> list[Any]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def start_checkpointing(settings: CheckpointSettings, model: nn.Module, engine: CheckpointedEngine,
                        optimizer_class: type, optimizer_kwargs: dict[str, Any], total_steps: int, steps_per_epoch: int,
                        group_ranks: list[int] | None = None,
                        full_names: dict[str, str] | None = None,
                        agree_groups: tuple[Any, Any] = (None, None)) -> CheckpointSession:
    """Resume from ``settings.directory`` when it holds a checkpoint (or as ``resume`` says) and attach the listener.

    ``model`` is the part of the model this rank trains, replicated on
    ``group_ranks`` (default: every rank); each group persists its own layers
    into its own model file. ``full_names`` maps the part's ``state_dict`` keys
    to the whole model's, so an export can put the parts back together.
    ``agree_groups``: where ranks agree on an "auto" interval (:class:`CheckpointListener`).

    Raises:
        UsageError: the directory is a file, not writable, on a full disk; it
            holds another model's checkpoint; ``resume`` is True and there is
            nothing to resume; or every area is damaged (nothing is overwritten).
    """
    directory = check_directory(settings.directory)
    rank, world, peers = _topology(group_ranks)
    writer = peers[0]
    layout = model_layout(model, optimizer_class, optimizer_kwargs)
    mpath, rpath = model_file(directory, writer), rank_file(directory, rank)
    model_reports = rank_reports = None
    if settings.resume is not False:
        model_reports = _open_reports(mpath, layout.signature(), layout)
        rank_reports = _open_reports(rpath, None, None)
    # A resume may replay (rank files written only with the full snapshots, or a log past their
    # newest step) whatever this run writes: its rank files are the listener's choice below.
    replay = replay_ok(engine, full_names)
    points = restore_points(mpath, model_reports or [])
    rank_steps = valid_steps(rank_reports or [])
    steps = sorted(set(points) & set(rank_steps))
    # With replay a rank's file need only hold the snapshot a log record extends.
    replayable = sorted(t for t, p in points.items() if replay and p.updates and p.report.record.step in rank_steps)
    # Files whose areas are empty, or hold only a first checkpoint some other file lacks, are no
    # checkpoint; any other committed area, of the model file or a rank's file, is the user's data.
    reports = (model_reports or []) + (rank_reports or [])
    mine = _Holding(found=any(not r.empty for r in reports), steps=steps, replayable=replayable, writer=writer,
                    first_commit_only=all(r.empty or (r.valid and r.record.generation == 1) for r in reports))
    everyone: list[_Holding] = _gather(mine, world)
    start = ResumePoint()
    common = set.intersection(*(set(held.steps) for held in everyone))
    common_replay = set.intersection(*(set(held.replayable) for held in everyone))
    if common or common_replay:
        if max(common_replay, default=-1) > max(common, default=-1):
            start = _restore_for_replay(points[max(common_replay)], model_reports, rank_reports, mpath, rpath,
                                        model, engine)
        else:
            start = _restore(points[max(common)], model_reports, rank_reports, mpath, rpath, model, engine,
                             optimizer_class, optimizer_kwargs, steps_per_epoch)
    elif settings.resume:
        raise UsageError(f"--resume: {directory} holds no checkpoint every rank committed")
    elif all(held.first_commit_only for held in everyone):
        # Empty, or killed while its first checkpoint was being written: some files hold it, some
        # never will, so no step can be restored and starting over loses nothing that could be.
        if rank == 0 and any(held.found for held in everyone):
            print(f"convoy: checkpoint: {directory}: the job was stopped before every rank had committed "
                  "its first checkpoint; starting from step 0", file=sys.stderr, flush=True)
    else:
        described = "; ".join([f"{p.name}: {r.describe()}" for p, reports in ((mpath, model_reports),
                               (rpath, rank_reports)) for r in reports or []]
                              + [f"{p.name} is missing" for p in (mpath, rpath) if not p.exists()])
        raise UsageError(f"no usable checkpoint in {directory}: {described or 'another rank lacks it'}; nothing "
                         "was overwritten (move the directory away, or pass --no-resume to start over)")
    need = AREAS * _rank_file_bytes(model, engine.sync) * (len(peers) if rank == writer else 1)
    if rank == writer:
        need += AREAS * layout.area_size()
    model_store, rank_store, model_gen, rank_gen = _open_for_writing(
        start, layout, mpath, rpath, points, model_reports, rank_reports, rank == writer, directory, need)
    if rank == 0:
        for note in start.notes:
            print(f"convoy: checkpoint: {note}", file=sys.stderr, flush=True)
    writers = [held.writer for held in everyone]
    files = CheckpointFiles(directory, rank=rank, writer_rank=writer, local_ranks=peers, model_store=model_store,
                            rank_store=rank_store, model_generation=model_gen, rank_generation=rank_gen,
                            other_writers=_other_writers_here(writer, writers), **_remote_writers(writer, writers),
                            peer_timeout_s=settings.timeout_s)
    listener = CheckpointListener(model, engine, files, every=settings.every, last_step=total_steps - 1,
                                  full_every=settings.full_every if differential_ok(engine.sync) else 0,
                                  steps_per_epoch=steps_per_epoch, budget=settings.budget, full_names=full_names,
                                  copy_on_write=type(engine.sync) is AllReduce,
                                  replay=replay and settings.rank_files == "full",
                                  quiet_until=start.reached, job=settings.job, agree_groups=agree_groups)
    engine.listeners.append(listener)
    return CheckpointSession(listener, start)


def differential_ok(sync: SyncStrategy) -> bool:
    """Whether the update a step applies is the optimizer's step on an averaged gradient that
    a sparse compressor made small: then differential checkpoints pay and replay exactly."""
    return type(sync) is AllReduce and not isinstance(sync.compressor, (IdentityCompressor, FP16Compressor))


def replay_ok(engine: CheckpointedEngine, full_names: dict[str, str] | None = None) -> bool:
    """Whether a resume can rebuild the rank files' state between full snapshots by replaying the
    logged steps, so that they need be written only with the full snapshots.

    It needs differential checkpoints (the log of each step's averaged gradient), a compressor
    whose memory update reads nothing of the other ranks (``Compressor.local``: not PowerSGD,
    not global block selection), no whole-step gate (clipping, fp16 loss scaling: a step's
    update then depends on every layer's exchange) and the whole model on this rank (data
    parallelism: a replayed forward needs no peer's activations).
    """
    sync = engine.sync
    return (differential_ok(sync) and isinstance(sync, AllReduce) and sync.compressor.local
            and engine.gate is None and full_names is None)


def _restore(point: RestorePoint, model_reports: list[AreaReport], rank_reports: list[AreaReport], mpath: Path,
             rpath: Path, model: nn.Module, engine: CheckpointedEngine, optimizer_class: type,
             optimizer_kwargs: dict[str, Any], steps_per_epoch: int) -> ResumePoint:
    step, chosen_model = point.step, point.report
    chosen_rank = valid_steps(rank_reports)[step]
    store = Store.open(mpath)
    try:
        _verified(store, chosen_model)
        states = restore_model(store, chosen_model.area, model)
    finally:
        store.close()
    if point.updates:
        try:
            updates = read_updates(mpath, point)
        except FormatError as exc:
            raise UsageError(f"{mpath}: step {step}, the newest step every rank committed, cannot be "
                             f"replayed ({exc}); nothing was overwritten") from None
        states = replay_updates(model, optimizer_class, optimizer_kwargs, states, updates)
    engine.load_optimizer_state(states)
    _restore_rank_file(rpath, chosen_rank, model, engine)
    engine.set_step(step)
    record = chosen_model.record
    notes = fallback_notes(str(mpath), model_reports, chosen_model) + \
        fallback_notes(str(rpath), rank_reports, chosen_rank)
    epoch, position = divmod(step, steps_per_epoch) if point.updates else (record.epoch, record.position)
    notes.append(f"resumed from {mpath.parent} at step {step} (epoch {epoch}, batch {position})"
                 + (f", {len(point.updates)} differential steps replayed" if point.updates else ""))
    return ResumePoint(step, epoch, position, notes)


def _restore_for_replay(point: RestorePoint, model_reports: list[AreaReport], rank_reports: list[AreaReport],
                        mpath: Path, rpath: Path, model: nn.Module, engine: CheckpointedEngine) -> ResumePoint:
    """Restore the full snapshot ``point`` extends, model and rank files, and have the sync strategy
    replay the log's steps after it: the training loop then runs them again from the snapshot."""
    snapshot = point.report
    base = snapshot.record.step
    chosen_rank = valid_steps(rank_reports)[base]
    store = Store.open(mpath)
    try:
        _verified(store, snapshot)
        engine.load_optimizer_state(restore_model(store, snapshot.area, model))
    finally:
        store.close()
    try:
        feed = ReplayFeed(read_updates(mpath, point))
    except FormatError as exc:
        raise UsageError(f"{mpath}: step {point.step}, the newest step every rank can replay to, cannot be "
                         f"replayed ({exc}); nothing was overwritten") from None
    _restore_rank_file(rpath, chosen_rank, model, engine)
    engine.set_step(base)
    engine.sync.start_replay(feed)
    record = snapshot.record
    notes = fallback_notes(str(mpath), model_reports, snapshot) + fallback_notes(str(rpath), rank_reports, chosen_rank)
    notes.append(f"resuming from {mpath.parent}: the full snapshot at step {base} (epoch {record.epoch}, batch "
                 f"{record.position}), then {point.step - base} steps replayed from its log to step {point.step}")
    return ResumePoint(base, record.epoch, record.position, notes, replay_to=point.step)


def _restore_rank_file(rpath: Path, report: AreaReport, model: nn.Module, engine: CheckpointedEngine) -> None:
    """Verify the rank file's area of ``report`` and load its buffers, RNG and sync state."""
    store = Store.open(rpath)
    try:
        _verified(store, report)
        restore_rank(store, report.area, model, engine.sync, engine.loss_scaler)
    finally:
        store.close()


def _verified(store: Store, report: AreaReport) -> None:
    try:
        report.ensure_verified(store)
    except FormatError as exc:
        raise UsageError(f"{store.path}: step {report.record.step}, the newest step every rank committed, "
                         f"is damaged ({exc}); nothing was overwritten") from None


def _open_for_writing(start: ResumePoint, layout: Layout, mpath: Path, rpath: Path, points: dict[int, RestorePoint],
                      model_reports: list[AreaReport] | None, rank_reports: list[AreaReport] | None,
                      is_writer: bool, directory: Path, need: int) -> tuple[Store | None, Store | None, int, int]:
    """The stores to write the next generations into, newer areas and log records than the resumed step erased."""
    if not start.step:
        rpath.unlink(missing_ok=True)   # a stale rank file must never look committed
        if is_writer:
            for area in range(AREAS):
                log_path(mpath, area).unlink(missing_ok=True)
        _check_space(directory, need)
        try:
            return (Store.create(mpath, layout) if is_writer else None), None, 0, 0
        except OSError as exc:
            raise UsageError(f"cannot create checkpoint {mpath}: {exc.strerror}") from None
    reached = start.reached   # the model file's step; the rank files' is start.step (a replay's snapshot)
    base = points[reached].report.record
    model_store = _reopen(mpath, model_reports, reached) if is_writer else None
    if is_writer and log_path(mpath, points[reached].report.area).exists():
        # The records up to the step were read and checked a moment ago: the log is cut there, not read again.
        DiffLog.reopen(log_path(mpath, points[reached].report.area), base.generation, base.step,
                       reached, chain=points[reached].updates).close()
    rank_store = _reopen(rpath, rank_reports, start.step)
    return (model_store, rank_store, base.generation, valid_steps(rank_reports)[start.step].record.generation)


def _reopen(path: Path, reports: list[AreaReport], step: int) -> Store:
    store = Store.open(path, writable=True)
    for report in reports:
        if report.valid and report.record.step > step:
            store.invalidate(report.area)   # from before the crash, newer than what the ranks agreed on
    return store


def _rank_file_bytes(model: nn.Module, sync: SyncStrategy) -> int:
    """One area of a rank's own file: buffers and RNG now, plus what the sync strategy may keep."""
    now = rank_layout(rank_state(model, sync), {}).area_size()
    return now + sync.state_bytes_bound(sum(p.numel() * p.element_size() for p in model.parameters()))


def _check_space(directory: Path, need: int) -> None:
    """Fail before training when the disk cannot hold every file this rank writes, or (the
    model file's writer) that the ranks on this machine write; the model file is also fallocated."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise UsageError(f"--checkpoint-dir {directory}: {free / 1e6:.1f} MB free, the checkpoint needs "
                         f"{need / 1e6:.1f} MB")
