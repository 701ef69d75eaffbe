"""The end of an exchange cycle: servers combine their clusters' parameters, layer by layer.

At the end of every T-th batch, as each layer's update becomes final (a
:class:`~convoy.engine.listeners.Listener` runs before the next forward may
use the layer), every cluster's server sends ``w_k * theta_k`` to the other
servers and adds what it receives in cluster order, so every server obtains the
same ``theta = sum_k w_k theta_k``; it sends it to its members. The weights ``w_k`` (:mod:`convoy.cluster.contribution`)
are computed from earlier cycles only, identically on every rank.

Drift bound: because every cluster receives the same ``theta``, the clusters
hold identical parameters after every exchange, and in between drift apart
for at most T batches: ``|theta_k - theta_j| <= 2 T lr max|update|``. Each
exchange records the measured drift before combining, ``max_k |theta_k - theta|
/ |theta|``, in the metrics (``drift``).
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist

from convoy.core import Listener, StepStats


class CycleOwner(Protocol):
    """What the exchange needs of its strategy (:class:`convoy.sync.hierarchical.Hierarchical`).

    A protocol rather than an import: the strategy imports this module, and
    dependencies run one way.
    """

    rank: int
    cluster: int
    plan: Any              # convoy.cluster.plan.ClusterPlan
    contributions: Any     # convoy.cluster.contribution.ContributionHistory
    groups: Any            # this cluster's process groups (``params``)
    inter: Any             # the servers' process group

    def is_exchange_step(self, step: int) -> bool: ...
    def servers(self, step: int) -> list[int]: ...
    def peers(self, server: int) -> list[int]: ...
    def count(self, step: int, where: str, sent: int, received: int) -> None: ...
    def note(self, step: int, **values: Any) -> None: ...
    def finish_sends(self) -> None: ...


def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _assign(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def swap(tensor: torch.Tensor, me: int, servers: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensor`` to every other server and receive theirs; all of them, in ``servers`` order.

    Point to point over one group of the whole job, rather than a group per
    set of servers: a re-election then needs no new process group (groups made
    by a subset of ranks must be made in the same order on all of them).
    """
    others = [s for s in servers if s != me]
    received = {s: torch.empty_like(tensor) for s in others}
    works = [dist.isend(tensor, s, group=group) for s in others]
    works += [dist.irecv(received[s], s, group=group) for s in others]
    for work in works:
        work.wait()
    return [tensor if s == me else received[s] for s in servers]


class CycleExchange(Listener):
    """Combines the clusters' parameters at the end of every exchange cycle.

    Args:
        sync: the hierarchical strategy whose clusters, servers and weights it uses.

    Besides the parameters, every rank keeps each layer's parameters as of the
    start of the cycle (the anchor), so that whichever member is elected
    next can tell how far its cluster moved. The clusters' optimizer state
    (momentum) is not exchanged.
    """

    def __init__(self, sync: CycleOwner):
        self.sync = sync
        self.anchors: dict[int, torch.Tensor] = {}
        # dot(delta, moved), |delta|^2, |moved|^2, |theta_k - theta|^2, |theta|^2 over the layers
        self._sums = torch.zeros(5, dtype=torch.float64)

    @property
    def _active(self) -> bool:
        return len(self.sync.plan.clusters) > 1

    def restore_anchors(self, anchors: dict[int, torch.Tensor]) -> None:
        """Take the cycle's anchors (by layer index) from a checkpoint, in place of those kept so far."""
        self.anchors = dict(anchors)

    def remember_start(self, bucket: Any) -> None:
        """Keep the first parameters of ``bucket``'s layers (before their first update)."""
        if not self._active:
            return
        for layer in bucket.layers:
            if layer.index not in self.anchors:
                self.anchors[layer.index] = _flat(layer.params).clone()

    def on_layer_updated(self, layer: Any, step: int) -> None:
        sync = self.sync
        if not (self._active and sync.is_exchange_step(step)):
            return
        flat = _flat(layer.params)
        nbytes = flat.numel() * flat.element_size()
        servers = sync.servers(step)
        server = servers[sync.cluster]
        peers = sync.peers(server)
        if sync.rank == server:
            # Every server adds the same tensors in the same order: the same result everywhere.
            parts = swap(flat * sync.contributions.weights()[sync.cluster], sync.rank, servers, sync.inter)
            combined = parts[0].clone()
            for part in parts[1:]:
                combined.add_(part)
            sync.count(step, "inter", nbytes * (len(servers) - 1), nbytes * (len(servers) - 1))
            anchor = self.anchors[layer.index]
            delta, moved = (flat - anchor).double(), (combined - anchor).double()
            away = (flat - combined).double()
            self._sums += torch.stack([delta.dot(moved), delta.dot(delta), moved.dot(moved), away.dot(away),
                                       combined.double().dot(combined.double())])
            for work in [dist.isend(combined, peer, group=sync.groups.params) for peer in peers]:
                work.wait()
            sync.count(step, "intra", nbytes * len(peers), 0)
        else:
            combined = torch.empty_like(flat)
            dist.recv(combined, server, group=sync.groups.params)
            sync.count(step, "intra", 0, nbytes)
        _assign(layer.params, combined)
        self.anchors[layer.index] = combined

    def on_step_end(self, step: int, stats: StepStats) -> None:
        sync = self.sync
        sync.finish_sends()
        if not (self._active and sync.is_exchange_step(step)):
            return
        table = self._share_cycle_figures(step)
        weights = sync.contributions.weights()
        agreements = table[:, 0].tolist()
        sync.contributions.record(agreements)
        norm = math.sqrt(float(table[0, 2]))
        drift = max(math.sqrt(float(v)) for v in table[:, 1]) / norm if norm > 0 else 0.0
        sync.note(step, exchange=True, contribution_weights=weights, agreement=agreements, drift=drift)

    def _share_cycle_figures(self, step: int) -> torch.Tensor:
        """Per cluster (rows, in cluster order): agreement a_k, |theta_k - theta|^2, |theta|^2; on every rank."""
        sync = self.sync
        servers = sync.servers(step)
        server = servers[sync.cluster]
        table = torch.empty(len(servers), 3, dtype=torch.float64)
        if sync.rank == server:
            dot, deltas, moves, away, norm = self._sums.tolist()
            agreement = dot / math.sqrt(deltas * moves) if deltas > 0 and moves > 0 else 1.0
            mine = torch.tensor([agreement, away, norm], dtype=torch.float64)
            table = torch.stack(swap(mine, sync.rank, servers, sync.inter))
            sync.count(step, "inter", (len(servers) - 1) * mine.nbytes, (len(servers) - 1) * mine.nbytes)
            for peer in sync.peers(server):
                dist.send(table, peer, group=sync.groups.params)
            sync.count(step, "intra", table.nbytes * len(sync.peers(server)), 0)
        else:
            dist.recv(table, server, group=sync.groups.params)
            sync.count(step, "intra", 0, table.nbytes)
        self._sums.zero_()
        return table
