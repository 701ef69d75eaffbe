"""What a checkpoint directory holds: the job that wrote it, and its state at the newest step every file holds.

A resume on another world reads the old job here before it writes anything:
:func:`recorded_job` says how many workers wrote the checkpoint, with what
global batch and layout; :func:`read_job` reads the rank files and the model
files named at the newest step all of them can restore.

Example::

    >>> job = recorded_job(Path("ckpt"))                    # JobRecord(world=4, global_batch=48, ...)
    >>> state = read_job(Path("ckpt"), 4, ["model-rank0.ckpt"])
    >>> state.step, len(state.states)                       # (30, 4)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from convoy.checkpoint.files import rank_file
from convoy.checkpoint.format import CommitRecord, FormatError, Layout
from convoy.checkpoint.recovery import RestorePoint, restore_points, scan, valid_steps
from convoy.checkpoint.store import Store
from convoy.errors import UsageError


@dataclass
class JobRecord:
    """What a checkpoint says of the job that wrote it: workers, global batch (None: not recorded),
    its model files, and its layout (what :func:`convoy.train.elastic.job_layout` recorded; None:
    a checkpoint from before layouts were recorded)."""

    world: int
    global_batch: int | None
    model_files: int
    layout: dict[str, Any] | None = None


def rank_files(directory: Path) -> dict[int, Path]:
    """The rank files in ``directory`` by rank."""
    out = {}
    for path in directory.glob("state-rank*.ckpt"):
        number = path.name[len("state-rank"):-len(".ckpt")]
        if number.isdigit():
            out[int(number)] = path
    return out


def recorded_job(directory: Path) -> JobRecord | None:
    """The world size, global batch and layout of the newest committed checkpoint in ``directory``;
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
    return JobRecord(int(world), own.get("global_batch") or extra.get("global_batch"), len(models),
                     own.get("layout") or extra.get("layout"))


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


@dataclass
class ModelPart:
    """One model file at the step read: the restore point that reaches it (a snapshot, and the
    log records after it)."""

    path: Path
    layout: Layout
    point: RestorePoint

    @property
    def record(self) -> CommitRecord:
        """The record of the snapshot the step extends."""
        return self.point.report.record

    def slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of every slot's tensors (parameters, optimizer state) by slot name.

        Raises:
            UsageError: the step lies in the snapshot's log (its updates would have to be replayed),
                or the snapshot is damaged.
        """
        if self.point.updates:
            raise UsageError(f"{self.path}: step {self.point.step} is reached by replaying its differential log; "
                             "only a full snapshot can be re-laid out; nothing was changed")
        store = Store.open(self.path)
        try:
            self.point.report.ensure_verified(store)
            out = {}
            for index, slot in enumerate(store.layout.slots):
                tensors = store.tensors(self.point.report.area, index)
                out[slot.name] = {key: value.clone() for key, value in tensors.items()}
                del tensors   # release the views of the mapping
            return out
        except FormatError as exc:
            raise UsageError(f"{self.path}: step {self.point.step} is damaged ({exc}); nothing was changed") from None
        finally:
            store.close()


@dataclass
class JobState:
    """The old job at ``step``: every rank file's tensors, and the model files asked for."""

    step: int
    retrained: int                       # steps some model file holds after ``step`` (trained again)
    record: CommitRecord                 # rank 0's rank-file record of ``step``: generation, epoch, position
    states: list[dict[str, torch.Tensor]]
    models: dict[str, ModelPart]


def read_job(directory: Path, old_world: int, models: Sequence[str]) -> JobState:
    """The newest step that every model file named in ``models`` can restore and every rank file
    of the ``old_world`` workers holds, with the rank files' tensors of it. Reads only.

    Raises:
        UsageError: a rank or model file is missing or damaged, or no step is held by them all.
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
    parts: dict[str, tuple[Layout, dict[int, RestorePoint]]] = {}
    for name in models:
        try:
            store = Store.open(directory / name)
        except (OSError, FormatError) as exc:
            raise UsageError(f"{directory / name} is not a usable checkpoint: {exc}; nothing was changed") from None
        try:
            parts[name] = (store.layout, restore_points(directory / name, scan(store, verify_all=False)))
        finally:
            store.close()
    # A step a model file reaches through its log counts too: a resume applies the logged updates
    # to the model (the rank files hold that step's state themselves, so nothing per rank is replayed).
    full = set.intersection(*(set(points) for _, points in parts.values())) if parts else None
    stores, reports_by_rank = [], []
    try:
        for rank in range(old_world):
            stores.append(Store.open(files[rank]))
            reports_by_rank.append(valid_steps(scan(stores[-1])))
            full = set(reports_by_rank[-1]) if full is None else full & set(reports_by_rank[-1])
        if not full:
            files_named = "the model files" if len(parts) > 1 else "the model file"
            raise UsageError(f"no step of {directory} is held by {files_named} and all {old_world} rank files; "
                             "nothing was changed (move the directory away, or pass --no-resume)")
        step = max(full)
        states = []
        for rank, store in enumerate(stores):
            tensors = store.tensors(reports_by_rank[rank][step].area, 0)
            states.append({k: v.clone() for k, v in tensors.items()})
            del tensors
        record = reports_by_rank[0][step].record
    except FormatError as exc:
        raise UsageError(f"{directory}: a rank file is damaged ({exc}); nothing was changed") from None
    finally:
        for store in stores:
            store.close()
    retrained = max((max(points) - step for _, points in parts.values()), default=0)
    models = {name: ModelPart(directory / name, layout, points[step]) for name, (layout, points) in parts.items()}
    return JobState(step, retrained, record, states, models)


def check_model_file(path: Path, layout: Layout, role: str = "") -> None:
    """Check that the model file ``path`` has ``layout`` (``role``: what the file holds, for the message).

    Raises:
        UsageError: one line, when the file is missing, unreadable or of another layout.
    """
    try:
        store = Store.open(path)
    except (OSError, FormatError) as exc:
        raise UsageError(f"{path}{role} is not a usable checkpoint: {exc}; nothing was changed") from None
    try:
        mismatch = layout.first_mismatch(store.layout)
    finally:
        store.close()
    if mismatch:
        raise UsageError(f"{path}{role} holds a checkpoint of a different model: {mismatch} "
                         "(use another --checkpoint-dir, or --no-resume to overwrite it)")
