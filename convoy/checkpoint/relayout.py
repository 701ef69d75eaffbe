"""Staging a re-layout's model files: one written from tensors, or an old one copied under a new name.

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

from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.format import CommitRecord, Layout
from convoy.checkpoint.store import AREAS, Store
from convoy.checkpoint.written import ModelPart


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
