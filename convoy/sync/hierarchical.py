"""Hierarchical sync: a temporary server per cluster every batch, clusters exchange every T batches.

Inside an exchange cycle each cluster is a synchronous data-parallel group:
every batch, each member sends its (compressed) gradient to the cluster's
temporary server, which averages the cluster's gradients and sends the
average back, so every member applies the same update. At the end of every
T-th batch the servers exchange their clusters' parameters, combine them with
contribution weights (:mod:`convoy.cluster.contribution`) and send the result
to their members (:class:`CycleExchange`). Servers are re-elected every R
cycles (:class:`convoy.cluster.election.Election`).

Checkpoints: each cluster is a replica group of its own (its members hold the
same parameters and momentum), so each cluster persists its own model file
(:meth:`Hierarchical.replica_ranks`), and checkpoints fall on exchange steps
(:meth:`Hierarchical.checkpoint_period`), where every cluster holds the same
parameters. The plan, the contribution history and the cycle anchors go into
each rank's own file (:meth:`Hierarchical.state_tensors`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy.cluster.contribution import ContributionHistory
from convoy.cluster.plan import ClusterPlan
from convoy.compress import Compressor, Memory
from convoy.errors import UsageError
from convoy.sync.allreduce import AllReduce
from convoy.sync.base import Done, PendingSync, SyncStrategy
from convoy.sync.cycle import CycleExchange
from convoy.sync.rows import pack_row, row_extent, sum_rows

# T, batches per exchange cycle, unless told: the clusters' parameters combined every 4th batch.
DEFAULT_EXCHANGE_EVERY = 4


class _PendingStar(PendingSync):
    """A star exchange in flight: done once every receive has completed."""

    def __init__(self, works: list[Any], finish: Callable[[], torch.Tensor]):
        self._works = works
        self._finish = finish

    def is_done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._finish()


@dataclass(frozen=True)
class ClusterGroups:
    """The process groups of one cluster: point-to-point gradients, parameters, and collectives.

    Separate groups keep the three kinds of traffic, issued at different
    moments of a step, from being matched against each other.
    """

    members: list[int]
    grads: Any
    params: Any
    agree: Any


@dataclass(frozen=True)
class ClusterNetwork:
    """Every process group a plan needs: per cluster (gradients, parameters,
    collectives) and one for the servers' exchange (empty and ``None`` without torch.distributed).

    Built by :func:`convoy.parallel.groups.cluster_network` on every rank of the
    job, in the same order, also the ranks outside the plan (the other group of
    a hybrid job): process groups are created collectively.

    Example::

        >>> conv, fc = cluster_network(conv_plan), cluster_network(fc_plan)   # on every rank
        >>> sync = Hierarchical(conv_plan, 4, network=conv)                   # on the conv ranks
    """

    clusters: list[ClusterGroups]
    inter: Any


class Hierarchical(AllReduce):
    """Cluster-wise synchronous data parallelism through rotating temporary servers.

    Args:
        plan: the clusters and their election, the same on every rank
            (:func:`convoy.cluster.plan.plan_job`).
        exchange_every: T, batches per exchange cycle; at the end of every T-th
            batch the clusters' parameters are combined.
        compressor, memory, warmup_steps: as for :class:`AllReduce`; members
            compress the gradients they send to their server.
        last_step: the job's last step, also an exchange, so that training ends
            with one model on every rank whatever T (None: no such step).
        network: the plan's process groups, built on every rank beforehand
            (:func:`convoy.parallel.groups.cluster_network`).

    Pass ``listeners=strategy.listeners()`` to the engine: the exchange runs
    as each layer's update becomes final.

    Example::

        >>> plan = plan_job(DEFAULT_WEIGHTS, clusters=2, reelect_every=4)
        >>> sync = Hierarchical(plan, exchange_every=4, network=cluster_network(plan))   # on every rank
        >>> engine = Engine(model, torch.optim.SGD, sync, listeners=sync.listeners(), lr=0.05)
    """

    def __init__(self, plan: ClusterPlan, exchange_every: int, compressor: Compressor | None = None,
                 memory: Memory | None = None, warmup_steps: int = 0, last_step: int | None = None,
                 *, network: ClusterNetwork):
        if exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {exchange_every}")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.inter = network.inter   # servers' point-to-point exchange
        self.plan = plan
        self.cluster = plan.cluster_of(self.rank)
        self.members = plan.clusters[self.cluster]
        self.groups = network.clusters[self.cluster] if network.clusters else None
        super().__init__(self.groups.agree if self.groups else None, compressor, memory, warmup_steps)
        self.world_size = len(self.members)
        self.exchange_every = exchange_every
        self.last_step = last_step
        self.contributions = ContributionHistory([len(m) for m in plan.clusters])
        self.exchange = CycleExchange(self)
        self._step = 0
        self._outgoing: list[tuple[Any, Any]] = []   # sends in flight and the buffers they read
        self._metrics: dict[int, dict[str, Any]] = {}
        self._metrics_lock = threading.Lock()

    # ------------------------------------------------------------ the schedule
    def cycle_of(self, step: int) -> int:
        return step // self.exchange_every

    def is_exchange_step(self, step: int) -> bool:
        return (step + 1) % self.exchange_every == 0 or step == self.last_step

    def servers(self, step: int) -> list[int]:
        """Every cluster's server during ``step``."""
        return self.plan.servers(self.cycle_of(step))

    def server(self, step: int) -> int:
        return self.servers(step)[self.cluster]

    def listeners(self) -> list[CycleExchange]:
        return [self.exchange]

    # ------------------------------------------------------------ checkpoints
    def replica_ranks(self) -> list[int]:
        """This cluster: its members hold the same parameters and momentum after every step."""
        return list(self.members)

    def checkpoint_period(self, every: int) -> int:
        """``every`` rounded up to whole exchange cycles: checkpoints fall on exchange steps,
        where every cluster holds the same (combined) parameters, so the clusters' model
        files hold one model and an export of any of them is the job's model. Rounded also
        for one cluster, so that both groups of a hybrid job checkpoint at the same steps."""
        return -(-every // self.exchange_every) * self.exchange_every

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Residuals (and whatever else :class:`AllReduce` keeps), plus the cluster plan
        (``plan.*``), the contribution history (``contribution.*``) and the parameters each
        layer had at the start of the cycle (``anchor.<layer>``)."""
        out = super().state_tensors()
        out.update({f"plan.{key}": value for key, value in self.plan.as_tensors().items()})
        out["contribution.agreement_sum"] = torch.tensor(self.contributions.agreement_sum, dtype=torch.float64)
        out["contribution.cycles"] = torch.tensor([self.contributions.cycles], dtype=torch.int64)
        out.update({f"anchor.{index}": anchor for index, anchor in sorted(self.exchange.anchors.items())})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        saved = {key[len("plan."):]: value for key, value in tensors.items() if key.startswith("plan.")}
        mine = self.plan.as_tensors()
        if saved and (set(saved) != set(mine) or not all(torch.equal(saved[k], mine[k]) for k in mine)):
            raise UsageError("the checkpoint was written with other clusters than this job's "
                             f"({self.plan.clusters}); resume with the job's original settings, or --no-resume")
        if "contribution.cycles" in tensors:
            self.contributions.restore(tensors["contribution.agreement_sum"].tolist(),
                                       int(tensors["contribution.cycles"]))
        self.exchange.restore_anchors({int(key[len("anchor."):]): value.clone() for key, value in tensors.items()
                                       if key.startswith("anchor.")})

    def state_bytes_bound(self, params_bytes: int) -> int:
        """What :class:`AllReduce` keeps, one anchor per parameter, the plan and the history."""
        small = 24 * len(self.plan.ranks()) + 8 * len(self.plan.clusters) + 8
        return super().state_bytes_bound(params_bytes) + params_bytes + small

    # ------------------------------------------------------------- accounting
    def count(self, step: int, where: str, sent: int, received: int) -> None:
        """Count bytes of ``step`` moved inside (``"intra"``) or between (``"inter"``) clusters."""
        self._count(sent, received)
        with self._metrics_lock:
            record = self._record(step)
            record[f"{where}_cluster_bytes_sent"] += int(sent)
            record[f"{where}_cluster_bytes_received"] += int(received)

    def note(self, step: int, **values: Any) -> None:
        """Attach ``values`` to ``step``'s metrics."""
        with self._metrics_lock:
            self._record(step).update(values)

    def _record(self, step: int) -> dict[str, Any]:
        if step not in self._metrics:
            self._metrics[step] = {"cluster": self.cluster, "server": self.server(step),
                                   **{f"{w}_cluster_bytes_{d}": 0 for w in ("intra", "inter")
                                      for d in ("sent", "received")}}
        return self._metrics[step]

    def step_metrics(self, step: int) -> dict[str, Any]:
        with self._metrics_lock:
            record = self._record(step)
            del self._metrics[step]
            return record

    # ------------------------------------------------------- gradient exchange
    # The final exchange reads the step's server that start sets: the rounds block in start.
    defers_rounds = False
    # A replayed step would still run the cycle's exchange of parameters: no replay.
    start_replay = SyncStrategy.start_replay

    def start(self, bucket: Any, grad: torch.Tensor) -> PendingSync:
        self._step = self._exchanges.get(bucket.index, self._first_step)
        self.exchange.remember_start(bucket)
        self._reap_sends()
        return super().start(bucket, grad)

    def _exchange(self, compressor: Compressor, payload: Any, ctx: Any,
                  out: torch.Tensor | None = None) -> PendingSync:
        if len(self.members) == 1:
            return Done(compressor.decompress(payload, ctx))
        if compressor.summable:
            return self._star_sum(compressor, payload, ctx)
        return self._star_relay(compressor, payload, ctx)

    def peers(self, server: int) -> list[int]:
        """The members of this cluster other than ``server``."""
        return [m for m in self.members if m != server]

    def _star_sum(self, compressor: Compressor, payload: list[torch.Tensor], ctx: Any) -> PendingSync:
        """Summable payloads: members send theirs; the server adds them in rank order and returns the sum."""
        step, server, group = self._step, self.server(self._step), self.groups.grads
        size = sum(t.numel() * t.element_size() for t in payload)
        scale = len(self.members)
        if self.rank != server:
            replies = [torch.empty_like(t) for t in payload]
            works = [dist.isend(t.contiguous(), server, group=group) for t in payload]
            works += [dist.irecv(r, server, group=group) for r in replies]
            self.count(step, "intra", size, size)
            return _PendingStar(works, lambda: compressor.decompress(replies, ctx).div_(scale))
        received = {peer: [torch.empty_like(t) for t in payload] for peer in self.peers(server)}
        works = [dist.irecv(t, peer, group=group) for peer, ts in received.items() for t in ts]

        def finish() -> torch.Tensor:
            parts = [payload if m == self.rank else received[m] for m in self.members]
            total = [t.clone() for t in parts[0]]
            for tensors in parts[1:]:
                for acc, t in zip(total, tensors):
                    acc.add_(t)
            for peer in received:
                self._send(total, peer)
            self.count(step, "intra", size * len(received), size * len(received))
            return compressor.decompress([t.clone() for t in total], ctx).div_(scale)

        return _PendingStar(works, finish)

    def _star_relay(self, compressor: Compressor, payload: list[torch.Tensor], ctx: Any) -> PendingSync:
        """Payloads that differ per rank: the server gathers the members' rows and relays
        to each member the rows of the others; every member decodes all rows in rank order."""
        step, server, group = self._step, self.server(self._step), self.groups.grads
        dtypes = [t.dtype for t in payload]
        head, used = row_extent(payload)
        width = self._row_width(compressor, ctx, head, used)
        mine = pack_row(payload, width)
        peers = self.peers(server)
        others = len(self.members) - 1

        def average(rows: list[torch.Tensor]) -> torch.Tensor:
            return sum_rows(compressor, rows, dtypes, ctx)[0].div_(len(rows))

        if self.rank != server:
            relayed = torch.empty(others * width, dtype=torch.uint8)
            works = [dist.isend(mine, server, group=group), dist.irecv(relayed, server, group=group)]
            self.count(step, "intra", width, others * width)

            def finish_member() -> torch.Tensor:
                rows = list(relayed.split(width))
                rows.insert(self.members.index(self.rank), mine)
                return average(rows)

            return _PendingStar(works, finish_member)
        received = {peer: torch.empty(width, dtype=torch.uint8) for peer in peers}
        works = [dist.irecv(row, peer, group=group) for peer, row in received.items()]

        def finish_server() -> torch.Tensor:
            rows = [mine if m == self.rank else received[m] for m in self.members]
            for peer in peers:
                self._send([torch.cat([row for m, row in zip(self.members, rows) if m != peer])], peer)
            self.count(step, "intra", others * others * width, others * width)
            return average(rows)

        return _PendingStar(works, finish_server)

    def _send(self, tensors: list[torch.Tensor], peer: int) -> None:
        for t in tensors:
            self._outgoing.append((dist.isend(t, peer, group=self.groups.grads), t))

    def _reap_sends(self) -> None:
        self._outgoing = [(work, t) for work, t in self._outgoing if not work.is_completed()]

    def finish_sends(self) -> None:
        """Wait for the server's replies still on the wire (before their buffers may go)."""
        for work, _ in self._outgoing:
            work.wait()
        self._outgoing.clear()
