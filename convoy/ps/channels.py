"""Channels: C process groups (separate connections) between each server and each worker.

Each channel has a unique id; the channel -> priority map gives channel 0 the
most urgent slices, channel C-1 the least, each carrying about 1/C of the
bytes, so an urgent slice never queues in a socket behind bytes of a later
layer already handed to the kernel.

With acknowledgements (a credit window), every pair of ranks also has one
connection that carries nothing else: an acknowledgement sent on a data
channel would wait in that socket behind the receiver's own outgoing slices,
and a window whose acknowledgements wait behind as many bytes as it holds
keeps a link at most half busy when both directions are loaded.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from convoy.ps.roles import PSRoles


class Channels:
    """The process groups of every (server, worker, channel) triple this rank belongs to.

    The groups are created by :func:`convoy.parallel.groups.ProcessGroups.create`
    (on every rank, in one order, as torch requires).

    Args:
        roles: who serves and who trains.
        count: C, channels per server-worker pair.
        rank: this process's global rank.
        groups: this rank's channels: ``(server, worker, channel) -> group``.
        ack_groups: this rank's acknowledgement connections: ``(low rank, high rank) -> group``
            (empty: the job has no acknowledgements).

    Example::

        >>> channels = ProcessGroups.create(JobShape(3, servers=1), ps=PSSettings(channels=2)).channels
        >>> channels.id(0, 2, 1)
        3
    """

    def __init__(self, roles: PSRoles, count: int, rank: int,
                 groups: dict[tuple[int, int, int], dist.ProcessGroup | None],
                 ack_groups: dict[tuple[int, int], dist.ProcessGroup | None] | None = None):
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.roles, self.count, self.rank = roles, count, rank
        self._groups = dict(groups)
        self._ack_groups = dict(ack_groups or {})

    def ack_group(self, a: int, b: int) -> dist.ProcessGroup | None:
        """The acknowledgement connection of ranks ``a`` and ``b`` (None: the job has no acknowledgements)."""
        return self._ack_groups.get((min(a, b), max(a, b)))

    def group(self, server: int, worker: int, channel: int) -> dist.ProcessGroup:
        return self._groups[(server, worker, channel)]

    def id(self, server: int, worker: int, channel: int) -> int:
        """The channel's unique id in the job."""
        return ((self.roles.server_index(server) * self.roles.num_workers + self.roles.worker_index(worker)) * self.count
                + channel)


def channel_map(sizes_in_priority_order: Sequence[tuple[int, int]], channels: int) -> dict[int, int]:
    """Channel of each transfer unit: contiguous priority classes carrying equal shares of bytes.

    Args:
        sizes_in_priority_order: (unit id, bytes), most urgent first.
        channels: C.

    Example::

        >>> channel_map([(7, 10), (8, 10), (9, 20)], 2)
        {7: 0, 8: 0, 9: 1}
    """
    total = sum(size for _, size in sizes_in_priority_order) or 1
    mapping, before = {}, 0
    for unit, size in sizes_in_priority_order:
        # A unit's class is where the middle of its bytes falls.
        mapping[unit] = min(channels - 1, int(channels * (before + size / 2) / total))
        before += size
    return mapping
