"""Recovery: find the newest area whose record and checksums are intact, and restore from it.

Both areas of a file are checked: the commit record's own checksum, the
model signature, then every layer's CRC-32. An area being rewritten has no
record (it is erased before its first layer is written), a torn record or a
torn layer fails its checksum; either way the other area is used and the
reason is reported.

Example::

    >>> reports = scan(Store.open(path))
    >>> [r.describe() for r in reports]
    ['area A: step 12, generation 12, valid', 'area B: damaged (layer 'fc1' checksum mismatch)']
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pathlib import Path
from typing import Any, Iterable

from convoy.checkpoint.difflog import Entry, dense, log_path, read_chain, read_payload
from convoy.checkpoint.format import CommitRecord, FormatError
from convoy.checkpoint.snapshot import model_layers, optimizer_state, restore_parameters, restore_rank_state
from convoy.checkpoint.store import AREAS, Store, area_name
from convoy.core import SyncStrategy
from convoy.engine.optim import LayerOptimizer, bucket_optimizer


@dataclass
class AreaReport:
    """One area of a file: its record when valid, else what is wrong with it."""

    area: int
    record: CommitRecord | None
    problem: str | None = None
    verified: bool = True   # False: the record is intact, the layers' checksums not yet checked

    @property
    def valid(self) -> bool:
        return self.record is not None

    def ensure_verified(self, store: Store) -> None:
        """Check the layers of this area of ``store`` if ``scan`` left them unchecked; FormatError when damaged."""
        if not self.verified:
            store.verify(self.area)
            self.verified = True

    @property
    def empty(self) -> bool:
        """Never committed, or erased to be rewritten: no trace of a checkpoint, not damage."""
        return self.record is None and (self.problem or "").startswith("empty")

    def describe(self) -> str:
        if self.record is None:
            return f"area {area_name(self.area)}: {self.problem}"
        r = self.record
        return f"area {area_name(self.area)}: step {r.step} (epoch {r.epoch}, batch {r.position}), " \
               f"generation {r.generation}, valid"


def scan(store: Store, signature: str | None = None, verify_all: bool = True) -> list[AreaReport]:
    """Check the areas of ``store``: records, signature, every slot's checksum.

    Args:
        signature: the model signature the records must carry (None: any).
        verify_all: check the layers of every area; False checks them only in the
            newest area with an intact record and, if that one is damaged, the next
            (a resume reads one area: recovery then costs one pass over it).
    """
    reports, found = [], False
    for area in sorted(range(AREAS), key=lambda a: -_generation(store, a)):
        try:
            record = store.record(area)
            if signature is not None and record.extra.get("signature") != signature:
                raise FormatError("commit record belongs to another model signature")
            if verify_all or not found:
                store.verify(area)
            reports.append(AreaReport(area, record, verified=verify_all or not found))
            found = True
        except FormatError as exc:
            reports.append(AreaReport(area, None, _problem(exc)))
    return sorted(reports, key=lambda r: r.area)


def _generation(store: Store, area: int) -> int:
    try:
        return store.record(area).generation
    except FormatError:
        return -1


def _problem(exc: FormatError) -> str:
    if str(exc).startswith("no commit record"):
        return "empty (never committed, or being rewritten)"
    return f"damaged ({exc})"


def valid_steps(reports: list[AreaReport]) -> dict[int, AreaReport]:
    """Valid areas by the step they hold (the newer generation wins a tie)."""
    out: dict[int, AreaReport] = {}
    for report in sorted((r for r in reports if r.valid), key=lambda r: r.record.generation):
        out[report.record.step] = report
    return out


@dataclass
class RestorePoint:
    """A step a model file can restore: a valid area, and the log records replayed after its snapshot."""

    report: AreaReport
    updates: list[Entry]

    @property
    def step(self) -> int:
        return self.updates[-1].step if self.updates else self.report.record.step


def restore_points(path: Path, reports: list[AreaReport]) -> dict[int, RestorePoint]:
    """Every step ``path`` can restore: each valid area's own step, and the steps its
    differential log reaches (records checked); a full snapshot wins over a replay."""
    points: dict[int, RestorePoint] = {}
    for report in sorted((r for r in reports if r.valid), key=lambda r: r.record.generation):
        chain = read_chain(log_path(path, report.area), report.record.generation, report.record.step, verify=True)
        for n in range(len(chain)):
            points.setdefault(chain[n].step, RestorePoint(report, chain[:n + 1]))
    for report in sorted((r for r in reports if r.valid), key=lambda r: r.record.generation):
        points[report.record.step] = RestorePoint(report, [])
    return points


def replay_updates(model: nn.Module, optimizer_class: type, optimizer_kwargs: dict[str, Any],
                   states: dict[str, dict], updates: Iterable[dict]) -> dict[str, dict]:
    """Apply differential records to ``model`` (restored from their snapshot) and its optimizer ``states``.

    Each layer gets an optimizer as the engine builds them (foreach kernels;
    the updates are element-wise, so one per layer computes what one per
    bucket did) and takes each record's step with its averaged gradient and
    hyper-parameters: the result is bit-identical to the run that wrote them.
    Returns the optimizer states after the last record, by layer.
    """
    layers = {}
    for name, module, params in model_layers(model):
        optimizer = bucket_optimizer(optimizer_class, params, optimizer_kwargs)
        LayerOptimizer(optimizer, params).load_state_dict({"state": states.get(name, {})})
        layers[name] = (optimizer, params)
    for update in updates:
        for bucket in update["buckets"]:   # layers whose update the step skipped (fp16 overflow) are in none
            flat, offset = dense(bucket.grad), 0
            for name in bucket.layers:
                optimizer, params = layers[name]
                for param in params:
                    param.grad = flat[offset:offset + param.numel()].view_as(param)
                    offset += param.numel()
                optimizer.param_groups[0].update(bucket.hyper)
                optimizer.step()
            if offset != flat.numel():
                raise FormatError(f"a record of step {update['step']} holds {flat.numel()} values for "
                                  f"layers of {offset}")
    out = {}
    for name, (optimizer, params) in layers.items():
        for param in params:
            param.grad = None   # the engine's buckets start from empty gradients
        out[name] = LayerOptimizer(optimizer, params).state_dict()["state"]
    return out


def read_updates(path: Path, point: RestorePoint) -> list[dict]:
    """The records ``point`` replays, in order; FormatError when one is damaged."""
    return [read_payload(log_path(path, point.report.area), entry) for entry in point.updates]


def fallback_notes(path: str, reports: list[AreaReport], chosen: AreaReport) -> list[str]:
    """Sentences for the user when an area other than the newest-looking one is used."""
    notes = []
    for report in reports:
        if report is chosen:
            continue
        if not report.valid and not report.empty:
            notes.append(f"{path}: {report.describe()}; using area {area_name(chosen.area)} "
                         f"(step {chosen.record.step})")
        elif report.valid and report.record.step > chosen.record.step:
            notes.append(f"{path}: area {area_name(report.area)} (step {report.record.step}) is not "
                         f"committed by every rank; using step {chosen.record.step}")
    return notes


def restore_model(store: Store, area: int, model: nn.Module) -> dict[str, dict]:
    """Copy the parameters of ``area`` into ``model``; return each layer's optimizer state by name."""
    record = store.record(area)
    meta = record.extra.get("optimizer_meta", {})
    slots = {s.name: i for i, s in enumerate(store.layout.slots)}
    states = {}
    for name, module, _ in model_layers(model):
        tensors = store.tensors(area, slots[name])
        restore_parameters(module, tensors)
        states[name] = optimizer_state(tensors, meta.get(name, {}))
        del tensors   # release the views of the mapping
    return states


def restore_rank(store: Store, area: int, model: nn.Module, sync: SyncStrategy, scaler: object = None) -> None:
    """Put this rank's buffers, residuals, RNG state and fp16 loss scale back from ``area``."""
    tensors = store.tensors(area, 0)
    restore_rank_state(model, sync, tensors, scaler)
    del tensors


def state_dict_of(store: Store, area: int) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """``(model state_dict of the parameters, optimizer state by layer)`` read from ``area`` (copies)."""
    record = store.record(area)
    meta = record.extra.get("optimizer_meta", {})
    params, states = {}, {}
    for index, slot in enumerate(store.layout.slots):
        tensors = store.tensors(area, index)
        prefix = "" if slot.name == "<root>" else slot.name + "."
        for key, tensor in tensors.items():
            if key.startswith("param."):
                params[prefix + key[len("param."):]] = tensor.clone()
        states[slot.name] = optimizer_state(tensors, meta.get(slot.name, {}))
        del tensors
    return params, states


def rank_file_tensors(path: Path, prefix: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """Copies of the tensors named ``prefix.*`` (keys without the prefix) in a rank file's
    valid area of ``step`` (None: the newest); empty when the file, or such an area, is missing."""
    if not path.exists():
        return {}
    try:
        store = Store.open(path)
    except FormatError:
        return {}
    try:
        valid = valid_steps(scan(store))
        report = valid.get(max(valid) if step is None and valid else step)
        if report is None:
            return {}
        tensors = store.tensors(report.area, 0)
        out = {k[len(prefix) + 1:]: v.clone() for k, v in tensors.items() if k.startswith(prefix + ".")}
        del tensors   # release the views of the mapping before the store closes
        return out
    finally:
        store.close()
