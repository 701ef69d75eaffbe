"""``--sync hierarchical``: a temporary server per cluster every step, clusters meet every T steps.

Every step, inside each cluster of ``m`` hosts, members send each layer's
gradient to the cluster's server, which sends the average back: ``m-1`` copies
in, then ``m-1`` out, on the server's link, layer by layer as the engine
overlaps them. In every ``T``-th step, as each layer's update is final, the
auxiliary thread of each server all-reduces the layer's weighted parameters
with the other servers (over the links between clusters, the racks' when
clusters are racks) and sends the result to its members, who wait for it
(``convoy.sync.cycle``): a blocking stage after each update, which the next
forward's layer waits for. The step time reported is the average over a cycle.
"""
from __future__ import annotations

from convoy.errors import UsageError
from convoy.sim.cluster import Cluster
from convoy.sim.cpu import CpuCosts
from convoy.sim.network import allreduce, via_server
from convoy.sim.overlap import Transfer, simulate
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sync.allreduce import ring_allreduce_bytes
from convoy.sync.hierarchical import DEFAULT_EXCHANGE_EVERY

# K unless given. convoy train's default, auto, picks K from the profiled nodes; the simulator has no
# profiles, so it takes a count.
SIMULATED_CLUSTERS = 2


class ClusterCycles(Strategy):
    """Clusters with temporary servers and a cycle-wise exchange between clusters.

    Args:
        clusters: K; the nodes split into K equal clusters (the racks, when K equals them).
        exchange_every: T, steps per cycle.
        costs: this machine's CPU costs.

    Example::

        >>> ClusterCycles(clusters=2, exchange_every=10).step_time(profile, Cluster(4, 1e9, 2, 1e8))
    """

    def __init__(self, clusters: int = SIMULATED_CLUSTERS, exchange_every: int = DEFAULT_EXCHANGE_EVERY,
                 costs: CpuCosts | None = None):
        if clusters < 1 or exchange_every < 1:
            raise UsageError("hierarchical needs clusters >= 1 and exchange_every >= 1")
        self.clusters, self.exchange_every = clusters, exchange_every
        self.costs = costs or CpuCosts()

    @property
    def label(self) -> str:
        return f"hierarchical K={self.clusters} T={self.exchange_every}"

    def flags(self) -> list[str]:
        return ["--sync", "hierarchical", "--clusters", str(self.clusters),
                "--exchange-every", str(self.exchange_every)]

    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        if cluster.nodes % self.clusters:
            raise UsageError(f"{self.clusters} clusters do not divide {cluster.nodes} nodes")
        p = profile.scaled(cluster.slowdown)
        m, host = cluster.nodes // self.clusters, cluster.host_link()
        # Clusters are racks when they line up with them; else every link is a host link.
        between = cluster.inter_rack_link() if cluster.racks == self.clusters > 1 else cluster.ring_link()
        exchanges = [Transfer((i,), via_server(l.nbytes, m, host), reply_s=via_server(l.nbytes, m, host))
                     for i, l in reversed(list(enumerate(p.layers)))]
        forward, backward = [l.forward_s for l in p.layers], [l.backward_s for l in p.layers]
        t = simulate(forward, backward, [l.update_s for l in p.layers], exchanges)
        meet = [allreduce(l.nbytes, self.clusters, between) + via_server(l.nbytes, m, host) for l in p.layers]
        last = simulate(forward, backward, [l.update_s + c for l, c in zip(p.layers, meet)], exchanges)
        cycle_s = last.step_s - t.step_s
        # The server's link carries m-1 copies each way; its members' one: count the server's.
        sent = (m - 1) * p.nbytes + (ring_allreduce_bytes(p.nbytes, self.clusters) + (m - 1) * p.nbytes) \
            / self.exchange_every
        base = Breakdown.from_timeline(self.label, t, cluster, sent, self.costs.engine_ns_per_byte,
                                       cycle_exchange_s=cycle_s, step_without_exchange_s=t.step_s)
        return Breakdown(base.strategy, base.step_s + cycle_s / self.exchange_every, base.compute_s,
                         base.wire_s + sum(meet) / self.exchange_every, sent, base.notes)
