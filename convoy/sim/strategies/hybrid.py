"""``--parallel hybrid``: conv layers data-parallel on I workers, the FC head on J.

A conv worker runs its conv layers on its batch ``b``, sends the activations
and labels to its FC worker, waits for the gradient of the activations, and
runs backward through its conv layers; the conv ring exchanges conv layers
as the engine does. An FC worker takes ``n = I/J`` conv workers' batches one
after another over its own link, runs the head on ``n b`` samples, sends each
its gradient back; the FC ring (its own links) exchanges the head. To the
conv worker the whole head is one layer whose forward is the link out and
the head's forward, whose backward is the head's backward and the link back,
and whose update is the FC ring's.
"""
from __future__ import annotations

from convoy.errors import UsageError
from convoy.sim.cluster import Cluster
from convoy.sim.cpu import CpuCosts
from convoy.sim.network import allreduce, p2p
from convoy.sim.overlap import Transfer, simulate
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sync.allreduce import ring_allreduce_bytes

_LABEL_BYTES = 8     # an int64 label per sample forward
_LOSS_BYTES = 16     # loss and hits (two float64) back


class ConvFcSplit(Strategy):
    """Stanza-style conv/FC separation.

    Args:
        conv_workers: I.
        fc_workers: J; I must be a multiple of J, and I + J the cluster's nodes.
        costs: this machine's CPU costs.

    Example::

        >>> ConvFcSplit(3, 1).step_time(profile, Cluster(4, 1e9)).step_s
    """

    def __init__(self, conv_workers: int, fc_workers: int, costs: CpuCosts | None = None):
        if conv_workers < 1 or fc_workers < 1 or conv_workers % fc_workers:
            raise UsageError(f"hybrid needs I divisible by J, got I={conv_workers}, J={fc_workers}")
        self.conv_workers, self.fc_workers = conv_workers, fc_workers
        self.costs = costs or CpuCosts()

    @property
    def label(self) -> str:
        return f"hybrid {self.conv_workers}+{self.fc_workers}"

    def flags(self) -> list[str]:
        return ["--parallel", "hybrid", "--conv-workers", str(self.conv_workers),
                "--fc-workers", str(self.fc_workers)]

    def workers(self, cluster: Cluster) -> int:
        return self.conv_workers   # the ranks that read data

    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        if self.conv_workers + self.fc_workers != cluster.nodes:
            raise UsageError(f"hybrid {self.label} needs {self.conv_workers + self.fc_workers} nodes, "
                             f"the cluster has {cluster.nodes}")
        # The two roles mostly take turns: each has the shared cores while the other waits.
        conv_side, fc_side = cluster.with_active(self.conv_workers), cluster.with_active(self.fc_workers)
        conv = profile.scaled(conv_side.slowdown).split()[0]
        fan_in, b = self.conv_workers // self.fc_workers, profile.batch_size
        head = profile.scaled(fc_side.slowdown).split()[1].at_batch(fan_in * b)
        link = cluster.host_link()
        act = b * profile.activation_bytes
        link_out = fan_in * p2p(act + _LABEL_BYTES * b, link)
        link_back = fan_in * p2p(act + _LOSS_BYTES, link)
        fc_ring = sum(allreduce(l.nbytes, self.fc_workers, cluster.ring_link()) for l in head.layers)
        forward = [l.forward_s for l in conv.layers] + [link_out + sum(l.forward_s for l in head.layers)]
        backward = [l.backward_s for l in conv.layers] + [sum(l.backward_s for l in head.layers) + link_back]
        update = [l.update_s for l in conv.layers] + [sum(l.update_s for l in head.layers)]
        last = len(conv.layers)
        exchanges = [Transfer((last,), fc_ring, channel=1, remote=True)] + [
            Transfer((i,), allreduce(conv.layers[i].nbytes, self.conv_workers, cluster.ring_link()))
            for i in reversed(range(last))]
        t = simulate(forward, backward, update, exchanges)
        ring = sum(ring_allreduce_bytes(l.nbytes, self.conv_workers) for l in conv.layers)
        link_bytes = 2 * act + _LABEL_BYTES * b + _LOSS_BYTES
        fc_sent = sum(ring_allreduce_bytes(l.nbytes, self.fc_workers) for l in head.layers) + fan_in * link_bytes / 2
        return Breakdown.from_timeline(self.label, t, conv_side, ring + link_bytes / 2, self.costs.engine_ns_per_byte,
                                       link_s=link_out + link_back, fc_worker_sent_MB=fc_sent / 1e6)
