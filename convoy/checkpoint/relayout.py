"""Staging a re-layout's model files: one written from tensors, an old one copied under a new name,
or one rebuilt at a step of its differential log.

A data-parallel job keeps its one model file when it goes on with another
number of workers (:mod:`convoy.checkpoint.reshard`). A job whose model files
are parts of the model (hybrid groups, parameter-server shards) or per-cluster
copies of it (hierarchical sync) needs new ones, named after the new world's
writers: its mapping (``convoy.train.elastic_layouts``, ``elastic_ps``) stages
them here, beside the re-dealt rank files, in ``.reshard/``, and commits them
with :func:`convoy.checkpoint.reshard.commit_plan` (``put``: what goes in,
``retire``: :func:`old_files`, what goes aside). Until the plan is written the
directory is as it was.

Example::

    >>> staging = fresh_staging(directory)                  # convoy.checkpoint.reshard
    >>> put = copy_model_file(job.models["model-rank2.ckpt"], staging / "model-rank1.ckpt")
    >>> commit_plan(directory, {"from": 3, "to": 2, "step": job.step, "put": put, "retire": old_files(directory)})
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.format import CommitRecord, FormatError, Layout
from convoy.checkpoint.recovery import read_updates, replay_updates, restore_model
from convoy.checkpoint.snapshot import model_layers, slot_sources
from convoy.checkpoint.store import AREAS, Store
from convoy.checkpoint.written import ModelPart
from convoy.errors import UsageError


def write_model_file(path: Path, layout: Layout, slots: dict[str, dict[str, torch.Tensor]], record: CommitRecord,
                     extra: dict[str, Any]) -> list[str]:
    """A model file of ``layout`` holding ``slots`` (tensors by key, by slot name) as its one
    committed snapshot, of ``record``'s step and generation; ``extra`` goes into the record
    (its signature is set here). Returns the names written."""
    store = Store.create(path, layout)
    try:
        area = record.generation % AREAS
        store.invalidate(area)
        checksums = [store.write_tensors(area, index, [slots[slot.name][spec.key] for spec in slot.tensors],
                                         record.generation)
                     for index, slot in enumerate(layout.slots)]
        store.flush(area)
        store.commit(area, CommitRecord(record.generation, record.step, record.epoch, record.position, checksums,
                                        {**extra, "signature": layout.signature(), "time": time.time()}))
    finally:
        store.close()
    return [path.name]


def snapshot_model_file(part: ModelPart, path: Path, model: nn.Module, optimizer_class: type,
                        optimizer_kwargs: dict[str, Any], record: CommitRecord, job: dict[str, Any]) -> list[str]:
    """A model file at ``path`` holding ``part``'s state at its step as its one full snapshot, of
    the generation after the snapshot the step extends: that snapshot restored into ``model``
    and the log's records up to the step replayed, as a resume does (the same functions, so the
    same bits). Returns the names written.

    Args:
        part: the old model file at the step (a restore point that replays records).
        path: where the new file goes (``.reshard/``).
        model: a model of the file's layout; its parameters are overwritten (the resume that
            follows restores them from the new file).
        optimizer_class: the optimizer the records are replayed through.
        optimizer_kwargs: its hyper-parameters, as the resume would build it.
        record: the step's record in the rank files (its epoch and batch position).
        job: what the new record says of the job.

    Raises:
        UsageError: the snapshot or a record is damaged (nothing is changed).

    Example::

        >>> part = read_job(directory, 4, ["model-rank0.ckpt"]).models["model-rank0.ckpt"]
        >>> snapshot_model_file(part, staging / "model-rank0.ckpt", model, torch.optim.SGD, {"lr": 0.1}, record, job)
        ['model-rank0.ckpt']
    """
    area = part.point.report.area
    try:
        store = Store.open(part.path)
        try:
            part.point.report.ensure_verified(store)
            states = restore_model(store, area, model)
        finally:
            store.close()
        updates = read_updates(part.path, part.point)
    except FormatError as exc:
        raise UsageError(f"{part.path}: step {part.point.step} cannot be restored ({exc}); nothing was changed") \
            from None
    states = replay_updates(model, optimizer_class, optimizer_kwargs, states, updates)
    slots_by_name = {slot.name: slot for slot in part.layout.slots}
    slots, metas = {}, {}
    for name, module, params in model_layers(model):
        tensors, meta = slot_sources(module, params, states.get(name, {}), slots_by_name[name])
        slots[name] = {spec.key: tensor for spec, tensor in zip(slots_by_name[name].tensors, tensors)}
        if meta:   # as the persister records them: the layers whose optimizer keeps non-tensor state
            metas[name] = meta
    # The hyper-parameters the last replayed step used (an exported model reports them).
    last = updates[-1]["buckets"] if updates else []
    hyper = {**part.record.extra.get("hyper", {}), **(last[0].hyper if last else {})}
    snapshot = CommitRecord(part.record.generation + 1, part.point.step, record.epoch, record.position, [])
    return write_model_file(path, part.layout, slots, snapshot,
                            {**part.record.extra, **job, "hyper": hyper, "optimizer_meta": metas})


def copy_model_file(part: ModelPart, path: Path) -> list[str]:
    """Copy ``part``'s model file and its differential logs to ``path`` (the logs under ``path``'s
    names), the log of the snapshot the step extends cut after it: the old job's steps past it
    are trained again by the new one. Returns the names written."""
    source, names = part.path, []
    for old in [source, *sorted(source.parent.glob(source.name + ".diff*"))]:
        new = path.with_name(path.name + old.name[len(source.name):])
        shutil.copyfile(old, new)
        names.append(new.name)
    log = log_path(path, part.point.report.area)
    if log.exists():
        DiffLog.reopen(log, part.record.generation, part.record.step, part.point.step).close()
    return names


def old_files(directory: Path, *patterns: str) -> list[str]:
    """The names of the old job's model files and their logs in ``directory``, and of the files
    matching ``patterns`` (a layout's own, e.g. hierarchical plans): what a re-layout retires."""
    found = {p.name for pattern in ("model-rank*.ckpt", "model-rank*.ckpt.diff*", *patterns)
             for p in directory.glob(pattern) if p.is_file()}
    return sorted(found)
