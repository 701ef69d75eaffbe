"""convoy's engine with ``--sync allreduce``: every layer exchanged on its own, in reverse forward order."""
from __future__ import annotations

from convoy.sim.cluster import Cluster
from convoy.sim.codec import Compression
from convoy.sim.cpu import CpuCosts
from convoy.sim.network import Link, allgather, allreduce
from convoy.sim.overlap import Transfer, simulate
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sim.strategies.ddp import ddp_buckets
from convoy.sync.allreduce import ring_allreduce_bytes


def layer_exchange(collective: str, nbytes: int, n: int, link: Link) -> tuple[float, float]:
    """``(wire seconds, bytes one worker sends)`` of one layer's exchange among ``n`` ranks."""
    if n <= 1:
        return 0.0, 0
    if collective == "allgather":
        return allgather(nbytes, n, link), (n - 1) * nbytes
    return allreduce(nbytes, n, link), ring_allreduce_bytes(nbytes, n)


class LayerRing(Strategy):
    """Layer-wise ring all-reduce (or all-gather of sparse payloads), overlapped as the engine does.

    ``cluster.lanes`` collectives run at once (gloo's worker threads); global blocktopk's score
    all-reduce holds the auxiliary thread until it ends; compression shares the
    rank's cores with backward where it has fewer than two.

    Args:
        compression: what each layer's gradient becomes on the wire.
        costs: this machine's CPU costs (compression, bytes moved).
        bucket_mb: exchange consecutive layers together until their gradients hold
            this many MB, as the engine's ``bucket_bytes`` does; 0 (the default here)
            is one per layer. ``convoy train``'s engine keeps its own default
            (``convoy.engine.engine.DEFAULT_BUCKET_BYTES``), which this does not model.

    Example::

        >>> LayerRing(Compression("fp16")).step_time(profile, Cluster(4, 1e9)).step_s
    """

    def __init__(self, compression: Compression | None = None, costs: CpuCosts | None = None,
                 bucket_mb: float = 0):
        self.compression = compression or Compression()
        self.costs = costs or CpuCosts()
        self.bucket_mb = bucket_mb

    @property
    def label(self) -> str:
        buckets = f" {self.bucket_mb:g}MB buckets" if self.bucket_mb else ""
        return "allreduce" + ("" if self.compression.name == "none" else " " + self.compression.label()) + buckets

    def flags(self) -> list[str]:
        return self.compression.flags()

    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        p = profile.scaled(cluster.slowdown)
        n, link = cluster.nodes, cluster.ring_link()
        exchanges, sent = [], 0.0
        for bucket in ddp_buckets(p.layers, self.bucket_mb, self.bucket_mb):
            shapes = tuple(s for i in bucket for s in p.layers[i].shapes)
            wire, moved = layer_exchange(*self.compression.payload(shapes), n, link)
            agree_wire, agree_moved = layer_exchange("allreduce", self.compression.agreement(shapes), n, link)
            agree = Transfer(tuple(bucket), agree_wire, bytes_s=agree_moved / link.bytes_per_s) if agree_moved else None
            codec = self.costs.seconds(self.compression, shapes, n) * cluster.slowdown
            exchanges.append(Transfer(tuple(bucket), wire, codec, bytes_s=moved / link.bytes_per_s, agree=agree))
            sent += moved + agree_moved
        t = simulate([l.forward_s for l in p.layers], [l.backward_s for l in p.layers],
                     [l.update_s for l in p.layers], exchanges, lanes=cluster.lanes, shared_rate=cluster.shared_rate)
        return Breakdown.from_timeline(self.label, t, cluster, sent, self.costs.engine_ns_per_byte)
