"""``--sync ps``: S server ranks own whole layers; W workers push gradients and pull parameters.

Every byte a worker pushes, the layer's server receives from all W workers,
and every byte pulled it sends W times: the servers' links are the
bottleneck. Each server link direction is one channel that sends one message
(a layer, or a slice of one) at a time without preemption; among the messages
waiting, ``fifo`` sends the one that became ready first, ``graph`` the one
the next forward needs first (lowest layer index). Slices let an urgent
layer overtake a large one after at most one slice. The server updates a
layer once all its gradients have arrived; the next forward's layer ``l``
waits only for layer ``l``'s parameters.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from convoy.errors import UsageError
from convoy.ps.settings import DEFAULT_PRIORITY, DEFAULT_SLICE_KB, PRIORITY_MODES
from convoy.ps.sharding import shard_layers
from convoy.sim.cluster import Cluster
from convoy.sim.cpu import CpuCosts
from convoy.sim.network import Link
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies.base import Breakdown, Strategy

_STEPS = 4
# "timed" (convoy's timing-aware order) is modelled as "graph": with per-layer
# times known exactly, both send what the next forward needs first.
PRIORITIES = PRIORITY_MODES


@dataclass(frozen=True)
class Message:
    """One transfer on a channel: ready at ``ready_s``, ``seconds`` long, ordered by ``key``."""

    layer: int
    ready_s: float
    seconds: float
    key: tuple


def schedule(messages: Sequence[Message], free_s: float) -> tuple[list[float], float]:
    """End time of each message on one non-preemptive channel free from ``free_s``; and when it frees.

    Whenever the channel is idle it takes, of the messages ready, the smallest ``key``.

    Example::

        >>> ends, _ = schedule([Message(0, 0, 2, (1,)), Message(1, 0, 1, (0,))], 0)
        >>> ends
        [3, 1]
    """
    ends = [0.0] * len(messages)
    arrivals = sorted(range(len(messages)), key=lambda i: messages[i].ready_s)
    ready: list[tuple[tuple, int]] = []
    now, next_arrival = free_s, 0
    while next_arrival < len(arrivals) or ready:
        while next_arrival < len(arrivals) and messages[arrivals[next_arrival]].ready_s <= now:
            i = arrivals[next_arrival]
            heapq.heappush(ready, (messages[i].key, i))
            next_arrival += 1
        if not ready:
            now = messages[arrivals[next_arrival]].ready_s
            continue
        _, pick = heapq.heappop(ready)
        now += messages[pick].seconds
        ends[pick] = now
    return ends, now


class ServerShards(Strategy):
    """Priority-scheduled parameter servers.

    Args:
        servers: S; the first S ranks only serve, the rest train.
        priority: ``graph`` (or ``timed``, the same here) or ``fifo``.
        slice_kb: largest message; ``None`` sends whole layers.
        costs: this machine's CPU costs.

    Example::

        >>> ServerShards(1, "graph", 256).step_time(profile, Cluster(5, 1e9))
    """

    def __init__(self, servers: int = 1, priority: str = DEFAULT_PRIORITY, slice_kb: float | None = DEFAULT_SLICE_KB,
                 costs: CpuCosts | None = None):
        if servers < 1 or priority not in PRIORITIES or (slice_kb is not None and not slice_kb > 0):
            raise UsageError(f"ps needs servers >= 1, priority in {PRIORITIES} and slice_kb > 0")
        self.servers, self.priority, self.slice_kb = servers, priority, slice_kb
        self.costs = costs or CpuCosts()

    @property
    def label(self) -> str:
        slices = f" slice {self.slice_kb:g}kB" if self.slice_kb else ""
        return f"ps S={self.servers} {self.priority}{slices}"

    def flags(self) -> list[str]:
        flags = ["--sync", "ps", "--servers", str(self.servers), "--priority", self.priority]
        return flags + (["--slice-kb", f"{self.slice_kb:g}"] if self.slice_kb else [])

    def workers(self, cluster: Cluster) -> int:
        return cluster.nodes - self.servers

    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        workers = self.workers(cluster)
        if workers < 1:
            raise UsageError(f"ps with {self.servers} servers needs more than {self.servers} nodes")
        cluster = cluster.with_active(workers)
        p = profile.scaled(cluster.slowdown)
        owner = shard_layers([l.nbytes for l in p.layers], self.servers)
        link = cluster.ring_link()
        free = {(s, d): 0.0 for s in range(self.servers) for d in ("in", "out")}
        pulled = [0.0] * len(p.layers)
        main, starts = 0.0, []
        for _ in range(_STEPS):
            starts.append(main)
            t = main
            for l, layer in enumerate(p.layers):
                t = max(t, pulled[l]) + layer.forward_s
            ready = [0.0] * len(p.layers)
            for l in reversed(range(len(p.layers))):
                t += p.layers[l].backward_s
                ready[l] = t
            main = t
            pushed = self._transfer(p, owner, ready, "in", free, workers, link)
            # The server applies the layer's update before anyone may pull it.
            available = [pushed[l] + p.layers[l].update_s for l in range(len(p.layers))]
            pulled = self._transfer(p, owner, available, "out", free, workers, link)
        step = starts[-1] - starts[-2]
        sent = float(p.nbytes)   # a worker pushes every gradient once (and pulls every parameter)
        notes = {"workers": workers}
        stolen = cluster.stolen_s(2 * sent * self.costs.engine_ns_per_byte * 1e-9)
        main_work = sum(l.forward_s + l.backward_s for l in p.layers)
        return Breakdown(self.label, step + stolen, main_work, 2 * p.nbytes * workers / self.servers
                         / link.bytes_per_s, sent, notes)

    def _transfer(self, p: ModelProfile, owner: list[int], ready: list[float], direction: str,
                  free: dict, workers: int, link: Link) -> list[float]:
        """When each layer has crossed its server's link in ``direction`` (all its slices, all workers)."""
        done = [0.0] * len(p.layers)
        for server in sorted(set(owner)):
            messages = []
            for l, layer in enumerate(p.layers):
                if owner[l] != server:
                    continue
                piece = self.slice_kb * 1024 if self.slice_kb else layer.nbytes
                remaining = layer.nbytes
                while remaining > 0:
                    size = min(piece, remaining)
                    remaining -= size
                    key = (ready[l], l) if self.priority == "fifo" else (l,)  # graph and timed
                    messages.append(Message(l, ready[l], link.transfer(workers * size), key))
            ends, free[(server, direction)] = schedule(messages, free[(server, direction)])
            for message, end in zip(messages, ends):
                done[message.layer] = max(done[message.layer], end)
        return done
