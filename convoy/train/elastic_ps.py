"""Resuming a parameter-server job on another number of workers: re-shard the servers, re-deal the workers.

A ``--sync ps`` checkpoint holds each server's shard (its units' parameters
and optimizer state) in a model file, and each worker's state (error-feedback
residuals and momentum-correction velocities of every unit it pushes, buffers,
RNG) in its rank file.

``--servers colocated``: every rank serves a shard, and a shard's units (whole
layers, rows of the large ones, :func:`convoy.ps.job.plan_shards`) depend on
the number of ranks. The whole model and its optimizer state are put back
together from the old shards, row range by row range (every unit must be found
exactly once, with the shapes its plan gives it: else the checkpoint is of
another model), and cut again by the new world's plan: the parameters and the
optimizer state after the resume are the checkpoint's, bit for bit. The
workers' state is put together the same way, per layer, re-dealt over the new
workers keeping its mean (the update is the servers' mean of the pushes,
:mod:`convoy.checkpoint.deal`), and cut into the new units.

``--servers 1``: the server's shard holds every layer whole whatever the world:
its model file is kept (copied to each node's writer), its own rank file stays
rank 0's, and the workers' rank files are re-dealt over the new workers.

A switch between the two, or state of another kind than the deal knows (a
PowerSGD warm start belongs to a unit of the old cut), is refused in one line.

Example::

    >>> reshard_ps(Path("ckpt"), config, model, 4, 3, [0], job)
    (30, 0, 0, 'parameters and optimizer state re-sharded from 4 servers onto 3, ...')
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from convoy.checkpoint.deal import ADDITIVE, deal_states
from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.relayout import copy_model_file, old_files, write_model_file
from convoy.checkpoint.reshard import STAGING, commit_plan, fresh_staging, write_rank_file
from convoy.checkpoint.snapshot import model_layers, model_layout
from convoy.checkpoint.store import Store
from convoy.checkpoint.written import JobState, check_model_file, read_job
from convoy.errors import UsageError
from convoy.ps.job import Shard, ShardPlan, plan_shards
from convoy.ps.roles import PSRoles
from convoy.train.config import TrainConfig
from convoy.train.optim import optimizer_spec
from convoy.train.ps import ps_settings


def reshard_ps(directory: Path, config: TrainConfig, model: nn.Module, old_world: int, world: int,
               writers: list[int], job: dict[str, Any]) -> tuple[int, int, int, str]:
    """Map the ``--sync ps`` checkpoint of ``old_world`` ranks in ``directory`` onto ``world`` and put it
    in place (see the module's text). ``writers``: each node's first rank (``--servers 1`` keeps a
    copy of the server's file on each); ``job``: what the records say of the new job.

    Returns:
        the step, the logged steps trained again (none: a server's file has no log), the residual
        values dealt only to float32 precision, and what was done.

    Raises:
        UsageError: another model, a missing or damaged file, state that cannot be mapped;
            nothing is changed then.
    """
    settings = ps_settings(config)
    optimizer_class, hyper = optimizer_spec(config)
    if not settings.colocated:
        new = plan_shards(model, PSRoles(1, world), settings)
        check_model_file(model_file(directory, 0), model_layout(Shard(new, new.layers_of(0)), optimizer_class, hyper),
                         " (the server's shard)")
        state = read_job(directory, old_world, [model_file(directory, 0).name])
        workers, inexact = deal_states(state.states[1:], world - 1)
        staging = fresh_staging(directory)
        put = [name for writer in writers for name in copy_model_file(state.models[model_file(directory, 0).name],
                                                                       staging / model_file(directory, writer).name)]
        _write(directory, state, [state.states[0]] + workers, put, job)
        return (state.step, state.retrained, inexact, f"the server's shard kept, the workers' state re-dealt from "
                f"{old_world - 1} workers to {world - 1}")
    old = plan_shards(model, PSRoles.colocate(old_world), dataclasses.replace(settings, shard_weights=()))
    new = plan_shards(model, PSRoles.colocate(world), settings)
    names = [model_file(directory, rank).name for rank in range(old_world)]
    found = sorted(u for rank in range(old_world) for u in _shard_units(directory, rank, old, optimizer_class, hyper))
    if found != list(range(len(old.units))):
        raise UsageError(f"the model files of {directory} do not hold every shard of a --servers colocated job of "
                         f"{old_world} ranks exactly once; nothing was changed (resume on {old_world} workers, or "
                         "pass --no-resume)")
    state = read_job(directory, old_world, names)
    slots = {slot: tensors for name in names for slot, tensors in state.models[name].slots().items()}
    metas = {slot: meta for name in names
             for slot, meta in state.models[name].record.extra.get("optimizer_meta", {}).items()}
    whole, meta = _join(old, slots, metas)
    workers, inexact = deal_states([_worker_layers(old, s) for s in state.states], world)
    staging = fresh_staging(directory)
    record = state.models[names[0]].record
    put = []
    for rank in range(world):
        shard = Shard(new, new.layers_of(rank))
        units = new.layers_of(rank)
        extra = {**record.extra, **job, "full_names": shard.full_names,
                 "forward_order": [name for name, _, _ in model_layers(shard)],
                 "optimizer_meta": {f"p{u}": meta[new.units[u][0]] for u in units if meta[new.units[u][0]]}}
        put += write_model_file(staging / model_file(directory, rank).name,
                                model_layout(shard, optimizer_class, hyper),
                                {f"p{u}": _cut(new, whole[new.units[u][0]], u) for u in units}, record, extra)
    _write(directory, state, [_worker_units(new, s) for s in workers], put, job)
    return (state.step, 0, inexact, f"parameters and optimizer state re-sharded from {old_world} servers onto "
            f"{world}, the workers' state re-dealt")


def _write(directory: Path, state: JobState, ranks: list[dict[str, torch.Tensor]], put: list[str],
           job: dict[str, Any]) -> None:
    """Stage the new rank files beside the model files already staged (``put``) and commit."""
    staging = directory / STAGING
    for rank, tensors in enumerate(ranks):
        write_rank_file(staging / rank_file(directory, rank).name, tensors, rank, state.record, job)
    commit_plan(directory, {"from": len(state.states), "to": len(ranks), "step": state.step, "put": put,
                            "retire": old_files(directory)})


def _shard_units(directory: Path, rank: int, plan: ShardPlan, optimizer_class: type, hyper: dict[str, Any]
                 ) -> list[int]:
    """The units ``rank``'s model file holds (its slots ``p<unit>``), after checking that they hold
    what ``plan`` gives them (else the checkpoint is of another model)."""
    path = model_file(directory, rank)
    try:
        store = Store.open(path)
    except (OSError, FormatError) as exc:
        raise UsageError(f"{path} is not a usable checkpoint: {exc}; nothing was changed") from None
    try:
        units = sorted(int(slot.name[1:]) for slot in store.layout.slots if slot.name[1:].isdigit())
    finally:
        store.close()
    if any(u >= len(plan.units) for u in units):
        raise UsageError(f"{path} holds shard units beyond the {len(plan.units)} this model is cut into (a "
                         "checkpoint of another model? use another --checkpoint-dir, or --no-resume)")
    check_model_file(path, model_layout(Shard(plan, units), optimizer_class, hyper), f" (server {rank}'s shard)")
    return units


def _params(plan: ShardPlan, layer: int) -> list[nn.Parameter]:
    """The whole layer's parameters, in the layer's order (a unit holds their rows)."""
    module = plan.layers[_first_unit(plan, layer)][1]
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _first_unit(plan: ShardPlan, layer: int) -> int:
    return next(u for u, (owner, _, _) in enumerate(plan.units) if owner == layer)


def _param_index(plan: ShardPlan, unit: int, key: str) -> int:
    """The position of the parameter a slot key belongs to (``param.<name>``, ``optim.<i>.<what>``)."""
    kind, rest = key.split(".", 1)
    if kind != "param":
        return int(rest.split(".", 1)[0])
    module = plan.layers[unit][1]
    return [name for name, p in module.named_parameters(recurse=False) if p.requires_grad].index(rest)


def _join(plan: ShardPlan, slots: dict[str, dict[str, torch.Tensor]], metas: dict[str, dict]
          ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
    """Each layer's whole slot (parameters and optimizer tensors, by key) and optimizer meta,
    from its units' slots: a tensor shaped like its parameter's rows goes into those rows, any
    other (a step count) must be the same in every unit of the layer."""
    whole: dict[int, dict[str, torch.Tensor]] = {}
    meta: dict[int, dict] = {}
    for unit, (layer, start, end) in enumerate(plan.units):
        mine = whole.setdefault(layer, {})
        for key, tensor in slots[f"p{unit}"].items():
            rows = plan.layers[unit][2][_param_index(plan, unit, key)]
            if start is not None and tensor.shape == rows.shape:
                full = _params(plan, layer)[_param_index(plan, unit, key)]
                mine.setdefault(key, torch.empty(full.shape, dtype=tensor.dtype))[start:end] = tensor
            elif mine.setdefault(key, tensor) is not tensor and not torch.equal(mine[key], tensor):
                raise UsageError(f"the shards of layer {plan.layers[unit][0]} hold different {key}; they cannot be "
                                 "put back together (resume on the checkpoint's number of workers)")
        if meta.setdefault(layer, metas.get(f"p{unit}", {})) != metas.get(f"p{unit}", {}):
            raise UsageError(f"the shards of layer {plan.layers[unit][0]} hold different optimizer state; they "
                             "cannot be put back together (resume on the checkpoint's number of workers)")
    return whole, meta


def _cut(plan: ShardPlan, layer: dict[str, torch.Tensor], unit: int) -> dict[str, torch.Tensor]:
    """A unit's slot from its layer's whole slot: its rows of every tensor shaped like its parameter."""
    number, start, end = plan.units[unit]
    if start is None:
        return dict(layer)
    params = _params(plan, number)
    return {key: t[start:end].contiguous() if t.shape == params[_param_index(plan, unit, key)].shape else t
            for key, t in layer.items()}


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` (tensors shaped as ``like``, one after another, flattened) as views shaped like them:
    a unit's rows of its parameters, or a layer's parameters."""
    out, offset = [], 0
    for p in like:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def _sync_items(state: dict[str, torch.Tensor], out: dict[str, Any]
                ) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """Each ``sync.<kind>.<unit or layer>`` entry of a worker's rank state as (key, kind, unit or
    layer, tensor), in order; every other entry is put into ``out`` as it comes, so ``out`` keeps the
    state's order (the order the worker's memory keeps its tensors in)."""
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        if kind != "sync":
            out[key] = value
            continue
        sub, _, part = rest.partition(".")
        yield key, sub, part, value


def _worker_layers(plan: ShardPlan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A worker's rank state with its per-unit additive state (``sync.residual.<unit>``: the unit's
    rows, flat) put together per layer (``sync.residual.L<layer>``: the layer's parameters, flat),
    in the order the worker's memory keeps them."""
    out: dict[str, Any] = {}
    layers: dict[tuple[str, int], list[torch.Tensor]] = {}
    seen: dict[tuple[str, int], set[int]] = {}
    for key, sub, unit, value in _sync_items(state, out):
        if sub not in ADDITIVE or not unit.isdigit():
            raise UsageError(f"the rank files hold {key!r}, state of a unit of the old shards that convoy cannot "
                             "cut again for another number of servers; resume on the checkpoint's number of workers")
        layer, start, end = plan.units[int(unit)]
        if (sub, layer) not in layers:
            layers[(sub, layer)] = [torch.empty(p.shape, dtype=value.dtype) for p in _params(plan, layer)]
            out[f"sync.{sub}.L{layer}"] = None   # its place in the memory's order
        for full, piece in zip(layers[(sub, layer)], _views(value, plan.layers[int(unit)][2])):
            (full if start is None else full[start:end]).copy_(piece)
        seen.setdefault((sub, layer), set()).add(int(unit))
    for (sub, layer), full in layers.items():
        if seen[(sub, layer)] != {u for u, (owner, _, _) in enumerate(plan.units) if owner == layer}:
            name = plan.layers[_first_unit(plan, layer)][0]
            raise UsageError(f"a rank file holds the {sub} of only some shards of layer {name}; it cannot be put "
                             "back together (resume on the checkpoint's number of workers)")
        out[f"sync.{sub}.L{layer}"] = torch.cat([t.reshape(-1) for t in full])
    return out


def _worker_units(plan: ShardPlan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_worker_layers` for ``plan``'s units: each layer's units in row order,
    where the layer was (the order in which a worker compresses them)."""
    out: dict[str, torch.Tensor] = {}
    for _, sub, layer, value in _sync_items(state, out):
        number = int(layer[1:])
        pieces = _views(value, _params(plan, number))
        for unit, (owner, start, end) in enumerate(plan.units):
            if owner == number:
                out[f"sync.{sub}.{unit}"] = torch.cat([(t if start is None else t[start:end]).reshape(-1)
                                                       for t in pieces])
    return out
