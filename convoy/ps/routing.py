"""Where every slice goes: its server, its priority and its channel (the same on every rank)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from convoy.ps.channels import channel_map
from convoy.ps.priority import PriorityPlan
from convoy.ps.settings import PSSettings
from convoy.ps.sharding import shard_layers
from convoy.ps.slicing import Slice, slice_table


@dataclass
class Routing:
    """The slice table and the maps built from it.

    Attributes:
        table: per layer, its slices.
        owner: per layer, the server (0..S-1, its position among the servers) that holds it.
        priority: slice id -> queue key (layer's priority rank, slice's part), smallest first.
        channel: slice id -> channel number 0..C-1 (0: the most urgent bytes).
    """

    table: list[list[Slice]]
    owner: list[int]
    priority: dict[int, tuple[int, int]]
    channel: dict[int, int]

    def __post_init__(self) -> None:
        self._by_id = {piece.id: piece for pieces in self.table for piece in pieces}

    def slice(self, slice_id: int) -> Slice:
        return self._by_id[slice_id]

    def layers_of(self, server: int) -> list[int]:
        return [layer for layer, owner in enumerate(self.owner) if owner == server]


def build_routing(layer_numels: Sequence[int], plan: PriorityPlan, settings: PSSettings,
                  element_size: int = 4, owner: Sequence[int] | None = None) -> Routing:
    """Slice every layer, give it to a server, and map its slices to priorities and channels.

    ``owner`` (server of each layer, 0..S-1) is given when another table of the
    same layers has placed them already (pushes travel in rows of their own size).

    Example::

        >>> routing = build_routing([10, 3], plan, PSSettings(servers=1, slice_bytes=16))
        >>> [len(pieces) for pieces in routing.table]
        [3, 1]
    """
    table = slice_table(layer_numels, settings.slice_bytes, element_size)
    if owner is None:
        owner = shard_layers([n * element_size for n in layer_numels], settings.servers)
    rank = plan.rank
    priority = {piece.id: (rank[piece.layer], piece.part) for pieces in table for piece in pieces}
    ordered = sorted(priority, key=priority.__getitem__)
    sizes = {piece.id: piece.numel * element_size for pieces in table for piece in pieces}
    channel = channel_map([(sid, sizes[sid]) for sid in ordered], settings.channels)
    return Routing(table, list(owner), priority, channel)
