"""Everything the ranks of a parameter-server job agree on, built once, collectively.

Every rank (servers and workers) builds the same :class:`PSJob` in the same
order: the channels (process groups), the priority plan (traced on the first
worker, broadcast), the pull routing (dense parameters, float32 slices) and
the push routing (gradient rows, byte slices; see :mod:`convoy.ps.push`), and
for each layer the workers that push it (all of them in data parallelism,
one group's in a hybrid job).

A *unit* is what one server owns and updates: a whole layer, or, with
colocated servers, a range of rows of a large layer (every parameter's dim 0),
so that each rank's shard is about 1/N of the bytes. With colocated servers a
unit's parameters are new ``Parameter`` objects viewing the model's storage:
the rank's server engine updates them in place (no copy), and their ``grad``
(the averaged gradient) stays apart from the model's (this rank's own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import dataclasses

import torch
from torch import nn

from convoy.ps.channels import Channels
from convoy.ps.plan import agree_on_plan
from convoy.ps.priority import PriorityPlan
from convoy.ps.push import RowCodec
from convoy.ps.roles import PSRoles
from convoy.ps.routing import Routing, build_routing
from convoy.ps.slicing import Slice
from convoy.ps.settings import PSSettings
from convoy.ps.sharding import place_units, shard_layers, split_layers
from convoy.ps.trace_graph import model_layers


@dataclass
class PSJob:
    """The job's agreed structure (identical on every rank).

    Attributes:
        layers: ``(name, module, params)`` of every unit (a whole layer, or rows of
            one), layers in registration order (a unit's index names it on every rank).
        index_of: ``id(module)`` -> the index of the module's first unit.
        units_of: ``id(module)`` -> the indices of the module's units.
        pull: slices of each layer's parameters (float32), their servers, priorities, channels.
        push: slices of each layer's gradient row (bytes), same servers and priorities.
        layer_workers: per layer, the worker ranks that push it and pull it.
        codec: row widths and decoding contexts per layer and step.
        layer_rank: per unit, the priority rank of its layer (of the layer's first unit).
    """

    roles: PSRoles
    settings: PSSettings
    channels: Channels
    plan: PriorityPlan
    layers: list[tuple[str, nn.Module, list[nn.Parameter]]]
    index_of: dict[int, int]
    pull: Routing
    push: Routing
    layer_workers: list[list[int]]
    codec: RowCodec
    units_of: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    layer_rank: list[int] = dataclasses.field(default_factory=list)

    def order(self, routing: Routing, piece: Slice, sender: int, receiver: int) -> tuple:
        """The queue key of ``piece`` (a slice of ``routing``) from rank ``sender`` to rank ``receiver``.

        Layers go by priority. Colocated, the units of a cut layer then go in
        turns by peer: at turn k every rank sends to the rank k places after it
        (pushes to that server, replies to that worker), so each link carries
        one stream at a time. In priority order alone every worker would push
        the same unit to the same server at once: that server's link full, the
        others idle. The next forward needs every unit of a layer before it
        can run it, so the order within a layer costs the forward nothing.
        """
        unit_rank, part = routing.priority[piece.id]
        turn = (receiver - sender) % self.roles.world_size if self.roles.colocated else 0
        return (self.layer_rank[piece.layer] if self.layer_rank else unit_rank, turn, unit_rank, part)

    def server_of(self, layer: int) -> int:
        """The global rank of the server that owns ``layer``."""
        return self.roles.server_ranks[self.pull.owner[layer]]

    def layers_of(self, server: int) -> list[int]:
        return self.pull.layers_of(self.roles.server_index(server))

    def shapes(self, layer: int) -> tuple[torch.Size, ...]:
        return tuple(p.shape for p in self.layers[layer][2])

    def numel(self, layer: int) -> int:
        return sum(p.numel() for p in self.layers[layer][2])


def build_job(model: nn.Module, channels: Channels, settings: PSSettings, example: torch.Tensor,
              codec: RowCodec, layer_workers: Sequence[Sequence[int]] | None = None,
              first_step: int = 0) -> PSJob:
    """This rank's copy of the job's structure; a collective over the default group.

    Args:
        channels: this rank's connections (:class:`convoy.parallel.groups.ProcessGroups`'s); their
            roles and rank are the job's and this process's.
        layer_workers: per layer of ``model``, the worker ranks that train it
            (default: every worker trains every layer).
        first_step: the step training starts at (the push capacity is the densest row from there on).
    """
    roles, rank = channels.roles, channels.rank
    plan = agree_on_plan(model, roles, rank, settings.priority, example)
    whole = model_layers(model)
    shards = plan_shards(model, roles, settings)
    units, layers = shards.units, shards.layers
    numels = [sum(p.numel() for p in params) for _, _, params in layers]
    unit_plan = _plan_of_units(plan, [i for i, _, _ in units])
    pull = build_routing(numels, unit_plan, settings, owner=shards.owner)
    capacities = [codec.capacity(i, n, tuple(p.shape for p in layers[i][2]), first_step)
                  for i, n in enumerate(numels)]
    push = build_routing(capacities, unit_plan, settings, element_size=1, owner=pull.owner)
    per_layer = [list(w) for w in layer_workers] if layer_workers is not None else [roles.workers] * len(whole)
    units_of: dict[int, list[int]] = {}
    for u, (i, _, _) in enumerate(units):
        units_of.setdefault(id(whole[i][1]), []).append(u)
    rank = unit_plan.rank
    layer_rank = [min(rank[v] for v in units_of[id(whole[i][1])]) for i, _, _ in units]
    return PSJob(roles, settings, channels, unit_plan, layers, {key: us[0] for key, us in units_of.items()},
                 pull, push, [per_layer[i] for i, _, _ in units], codec, units_of, layer_rank)


@dataclass
class ShardPlan:
    """Which server holds what: the job's units (whole layers, or, colocated, rows of the large ones) and
    the server (0..S-1, its position among the servers) that owns each. Worked out from the model and
    the settings alone, the same on every rank and with no collective, so that a checkpoint's shards can
    be cut again for another number of servers (``convoy.train.elastic_ps``).

    Attributes:
        units: ``(layer, first row, end row)`` per unit (rows ``None``: the whole layer), layers in
            :func:`~convoy.ps.trace_graph.model_layers` order.
        layers: ``(name, module, params)`` per unit (colocated: views of the layer's rows).
        owner: per unit, the server's position.
    """

    units: list[tuple[int, int | None, int | None]]
    layers: list[tuple[str, nn.Module, list[nn.Parameter]]]
    owner: list[int]

    def layers_of(self, server: int) -> list[int]:
        """The units the server at position ``server`` owns."""
        return [unit for unit, owner in enumerate(self.owner) if owner == server]


def plan_shards(model: nn.Module, roles: PSRoles, settings: PSSettings) -> ShardPlan:
    """The units of ``model`` and their servers under ``roles`` and ``settings`` (see :class:`ShardPlan`)."""
    whole = model_layers(model)
    if roles.colocated:
        units = split_layers([sum(p.numel() for p in params) for _, _, params in whole],
                             [_common_rows(params) for _, _, params in whole], roles.servers)
    else:
        units = [(i, None, None) for i in range(len(whole))]
    layers = [_unit(whole[i], start, end, alias=roles.colocated) for i, start, end in units]
    numels = [sum(p.numel() for p in params) for _, _, params in layers]
    owner = (place_units(units, [4 * n for n in numels], roles.servers, settings.shard_weights) if roles.colocated
             else shard_layers([4 * n for n in numels], roles.servers))
    return ShardPlan(units, layers, owner)


def _common_rows(params: Sequence[nn.Parameter]) -> int | None:
    """dim 0 shared by every parameter of a layer (the rows a unit can be cut along), else None."""
    rows = {p.shape[0] if p.dim() else None for p in params}
    return rows.pop() if len(rows) == 1 else None


def _unit(layer: tuple[str, nn.Module, list[nn.Parameter]], start: int | None, end: int | None,
          alias: bool) -> tuple[str, nn.Module, list[nn.Parameter]]:
    """A unit's (name, module, params): rows ``start:end`` of the layer, as views of its storage when ``alias``."""
    name, module, params = layer
    if start is None:
        return (name, module, [nn.Parameter(p.data) for p in params] if alias else params)
    return (f"{name}[{start}:{end}]", module, [nn.Parameter(p.data[start:end]) for p in params])


def _plan_of_units(plan: PriorityPlan, unit_layers: Sequence[int]) -> PriorityPlan:
    """The plan over units: a layer's units in row order, where the layer was."""
    if list(unit_layers) == list(range(len(plan.order))):
        return plan
    rank = plan.rank
    order = sorted(range(len(unit_layers)), key=lambda u: (rank[unit_layers[u]], u))
    return dataclasses.replace(plan, order=tuple(order), value=tuple(plan.value[i] for i in unit_layers),
                               unseen=tuple(u for u, i in enumerate(unit_layers) if i in plan.unseen))


class Shard(nn.Module):
    """A server's units as a module of their own: one child per unit, holding the model's parameters.

    The children are named ``p<unit index>`` and hold the very ``Parameter``
    objects of the model (colocated: views of their storage; no copy either way), under their own names, so the engine trains
    exactly the server's share and a checkpoint of it holds nothing else. With ``own_storage`` (colocated
    servers under bounded staleness) they hold copies instead: the worker of the same rank computes on
    older parameters than its server updates. With
    ``buffers_of``, the shard also mirrors that model's buffers under their own
    names (modules without parameters), so a worker's rank file, which keeps
    the buffers of the module it checkpoints, restores its batch-norm statistics.

    Example::

        >>> shard = Shard(job, [0, 3])
        >>> [name for name, _ in shard.named_parameters()]
        ['p0.weight', 'p0.bias', 'p3.weight', 'p3.bias']
    """

    def __init__(self, job: PSJob | ShardPlan, layers: Sequence[int], buffers_of: nn.Module | None = None,
                 own_storage: bool = False):
        super().__init__()
        self.layer_of: dict[int, int] = {}   # id(child) -> layer index
        self.params_of: dict[int, list[nn.Parameter]] = {}   # layer index -> the parameters updated here
        self.full_names: dict[str, str] = {}  # the shard's state_dict keys -> the model's
        for index in layers:
            name, module, params = job.layers[index]
            if own_storage:
                params = [nn.Parameter(p.detach().clone()) for p in params]
            self.params_of[index] = params
            holder = nn.Module()
            # A unit's parameters are the layer's (or, colocated, views of them), in the layer's order.
            names = [pname for pname, p in module.named_parameters(recurse=False) if p.requires_grad]
            for pname, p in zip(names, params):
                holder.register_parameter(pname, p)
                prefix = "" if name == "<root>" else name + "."
                self.full_names[f"p{index}.{pname}"] = prefix + pname
            self.add_module(f"p{index}", holder)
            self.layer_of[id(holder)] = index
        if buffers_of is not None:
            for name, buffer in buffers_of.named_buffers():
                *path, leaf = name.split(".")
                parent: nn.Module = self
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.Module())
                    parent = getattr(parent, part)
                parent.register_buffer(leaf, buffer)

    def forward(self, *args: object) -> None:
        raise RuntimeError("a server's shard is updated, never run")
