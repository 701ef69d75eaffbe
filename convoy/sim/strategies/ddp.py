"""The peers users run today: torch DDP, and DDP with torch's PowerSGD hook.

DDP fills buckets in reverse parameter order (the first capped at 1 MiB, the
rest at 25 MiB), all-reduces each as soon as it is full, and steps the
optimizer once after backward and every all-reduce: no overlap with the next
forward.
"""
from __future__ import annotations

from convoy.sim.cluster import Cluster
from convoy.sim.codec import numel_of
from convoy.sim.cpu import CpuCosts
from convoy.sim.network import allreduce
from convoy.sim.overlap import Transfer, simulate
from convoy.sim.profile import LayerProfile, ModelProfile
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sync.allreduce import ring_allreduce_bytes

_MIB = 1 << 20


def ddp_buckets(layers: tuple[LayerProfile, ...], bucket_mb: float = 25, first_mb: float = 1) -> list[list[int]]:
    """Layer indices per bucket, in the order DDP all-reduces them (caps of 0: one layer each,
    as convoy's engine exchanges with ``bucket_bytes=0``).

    Example::

        >>> ddp_buckets(profile.layers)   # vgg_fc: the last two FC layers, then the rest
        [[8, 7], [6, 5, 4, 3, 2, 1, 0]]
    """
    buckets, current, cap = [], [], first_mb * _MIB
    for i in reversed(range(len(layers))):
        current.append(i)
        if sum(layers[j].nbytes for j in current) >= cap:
            buckets.append(current)
            current, cap = [], bucket_mb * _MIB
    return buckets + ([current] if current else [])


def powersgd_floats(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    """``(uncompressed floats, P + Q floats)`` the PowerSGD hook sends for one tensor.

    A tensor is viewed as ``shape[0] x rest``; 1-D tensors and those whose
    factors would not be at least 2x smaller (``min_compression_rate``) go uncompressed.
    """
    numel = numel_of(shape)
    if len(shape) < 2:
        return numel, 0
    n, m = shape[0], numel // shape[0]
    r = min(rank, n, m)
    if (n + m) * r * 2 >= n * m:
        return numel, 0
    return 0, (n + m) * r


class TorchDDP(Strategy):
    """torch DDP (``powersgd_rank=0``) or DDP with torch's PowerSGD hook of that rank.

    Args:
        powersgd_rank: PowerSGD's matrix rank; 0 for plain DDP.
        bucket_mb: DDP's ``bucket_cap_mb``.
        powersgd_ns, powersgd_call_us: CPU nanoseconds per gradient element and
            rank, and microseconds per bucket, of the hook's matrix products and
            error feedback (measured against plain DDP on one process: lenet +1.8 ms,
            vgg_fc +10 ms per step at rank 2).
    """

    peer = True

    def __init__(self, powersgd_rank: int = 0, bucket_mb: float = 25, costs: CpuCosts | None = None):
        self.rank, self.bucket_mb = powersgd_rank, bucket_mb
        self.costs = costs or CpuCosts()

    @property
    def label(self) -> str:
        return f"ddp powersgd {self.rank}" if self.rank else "ddp"

    def flags(self) -> list[str]:
        return ["--powersgd-rank", str(self.rank)] if self.rank else []

    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        p = profile.scaled(cluster.slowdown)
        n, link = cluster.nodes, cluster.ring_link()
        exchanges, sent = [], 0.0
        for bucket in ddp_buckets(p.layers, self.bucket_mb):
            shapes = [s for i in bucket for s in p.layers[i].shapes]
            if self.rank:
                # Three all-reduces one after the other: uncompressed tensors, P, then Q.
                parts = [powersgd_floats(s, self.rank) for s in shapes]
                dense, factors = sum(a for a, _ in parts), sum(b for _, b in parts)
                sizes = [4 * dense, 4 * factors // 2, 4 * factors - 4 * factors // 2]
                numel = sum(numel_of(s) for s in shapes)
                codec = (numel * self.rank * self.costs.powersgd_ns * 1e-9
                         + self.costs.powersgd_call_us * 1e-6) * cluster.slowdown
            else:
                sizes, codec = [sum(p.layers[i].nbytes for i in bucket)], 0.0
            wire = sum(allreduce(b, n, link) for b in sizes)
            sent += sum(ring_allreduce_bytes(b, n) for b in sizes)
            exchanges.append(Transfer(tuple(bucket), wire, codec))
        t = simulate([l.forward_s for l in p.layers], [l.backward_s for l in p.layers],
                     [l.update_s for l in p.layers], exchanges, barrier=True)
        return Breakdown.from_timeline(self.label, t, cluster, sent, self.costs.peer_ns_per_byte)
