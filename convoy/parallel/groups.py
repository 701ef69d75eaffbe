"""The job's process groups, created once, in one place and one order on every rank.

torch creates a process group collectively: every rank of the default group
must call ``new_group`` for every group, in the same order, also for the groups
it is not a member of. So no component creates its own: :meth:`ProcessGroups.create`
makes every group a job's shape (:class:`~convoy.parallel.shape.JobShape`) and
settings call for, and each component receives the ones it uses. This module
is the only one in ``convoy/`` that calls ``dist.new_group``
(``tests/test_architecture.py`` checks it).

One kind of group depends on what is known only later: hierarchical sync's
clusters are planned from the nodes' measured profiles, after the job starts.
:func:`cluster_network` builds them, also here, called by every rank from one
place (:func:`convoy.train.hierarchical.build_hierarchy`).

Example::

    >>> shape = JobShape(world_size=4)
    >>> groups = ProcessGroups.create(shape, whole_step=True)   # on every rank
    >>> engine = Engine(model, torch.optim.SGD, AllReduce(groups.engine_of(shape, rank)), lr=0.05)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from convoy.cluster.plan import ClusterPlan
from convoy.parallel.shape import JobShape
from convoy.ps.channels import Channels
from convoy.ps.roles import PSRoles
from convoy.ps.settings import PSSettings
from convoy.sync.hierarchical import ClusterGroups, ClusterNetwork


@dataclass(frozen=True)
class ProcessGroups:
    """Every process group of one job (``None`` where the job needs no such group).

    Args:
        engines: one per ``shape.engine_groups``: the ranks whose gradients an
            engine averages (data parallelism: every rank; hybrid: the conv
            workers, then the FC workers). A separate group keeps the engine's
            collectives from interleaving with the loop's on the default group.
        whole_step: every rank, over which a step's whole gradient is spread for
            clipping and fp16 loss scaling (``--sync ps``, ``--parallel hybrid``).
        bookkeeping: every rank, for the training loop's divergence and stop agreement.
        ps_workers: ``--sync ps``: the workers (evaluation statistics, PowerSGD's agreement).
        channels: ``--sync ps``: the server-worker connections of this rank.
        agree_every, agree_full: the checkpoint's "auto" intervals, agreed over every rank.
    """

    engines: tuple[ProcessGroup | None, ...] = ()
    whole_step: ProcessGroup | None = None
    bookkeeping: ProcessGroup | None = None
    ps_workers: ProcessGroup | None = None
    channels: Channels | None = None
    agree_every: ProcessGroup | None = None
    agree_full: ProcessGroup | None = None

    @classmethod
    def create(cls, shape: JobShape, *, whole_step: bool = False, bookkeeping: bool = False,
               ps: PSSettings | None = None, agree_every: bool = False, agree_full: bool = False) -> ProcessGroups:
        """The job's groups; a collective: every rank calls it with the same arguments.

        Without ``torch.distributed`` no group is created; on one process only those a
        layout needs in any case (a parameter server's channels and workers, hybrid's two).

        Args:
            shape: the job's shape.
            whole_step: create the whole-step group (clipping or fp16 across ranks).
            bookkeeping: create the training loop's group.
            ps: ``--sync ps``'s settings: the channels and the workers' group.
            agree_every, agree_full: create the groups of the checkpoint's "auto" intervals.
        """
        if not dist.is_initialized():
            return cls(engines=tuple(None for _ in shape.engine_groups),
                       channels=_channels(shape, ps) if ps is not None else None)
        several = shape.world_size > 1   # one process needs no group of its own beside the default one
        # The order below is the order every rank creates them in; change it on every rank or not at all.
        channels = _channels(shape, ps) if ps is not None else None
        ps_workers = dist.new_group(ps_roles(shape, ps).workers) if ps is not None and not shape.hybrid else None
        whole = dist.new_group() if whole_step and several else None
        if shape.hybrid:
            engines = tuple(dist.new_group(ranks) for ranks in shape.engine_groups)
        else:   # a parameter server's workers push to the servers, with no engine group
            engines = (dist.new_group() if several and ps is None else None,)
        agree = [dist.new_group() if wanted and several else None for wanted in (agree_every, agree_full)]
        loop = dist.new_group() if bookkeeping and several else None
        return cls(engines, whole, loop, ps_workers, channels, *agree)

    def engine_of(self, shape: JobShape, rank: int) -> ProcessGroup | None:
        """The engine group ``rank`` belongs to (``None``: none, as a hybrid job's servers)."""
        index = next((i for i, ranks in enumerate(shape.engine_groups) if rank in ranks), None)
        return None if index is None else self.engines[index]


def ps_roles(shape: JobShape, settings: PSSettings) -> PSRoles:
    """Who serves and who trains: every rank when colocated, else S servers (a hybrid job's last ranks)."""
    if settings.colocated:
        return PSRoles.colocate(shape.world_size)
    return PSRoles(settings.servers, shape.world_size, servers_last=shape.hybrid)


def _channels(shape: JobShape, settings: PSSettings) -> Channels:
    """C process groups per server-worker pair, and one acknowledgement group per pair of ranks."""
    roles, rank = ps_roles(shape, settings), dist.get_rank() if dist.is_initialized() else 0
    ready = dist.is_initialized()
    groups, acks = {}, {}
    for server in roles.server_ranks:
        for worker in roles.workers:
            if server == worker:   # a colocated rank's own shard: pushed and pulled in memory
                continue
            for channel in range(settings.channels):
                group = dist.new_group([server, worker]) if ready else None
                if rank in (server, worker):
                    groups[(server, worker, channel)] = group
    if settings.acked:
        pairs = {tuple(sorted((s, w))) for s in roles.server_ranks for w in roles.workers if s != w}
        for pair in sorted(pairs):
            group = dist.new_group(list(pair)) if ready else None
            if rank in pair:
                acks[pair] = group
    return Channels(roles, settings.channels, rank, groups, acks)


def cluster_network(plan: ClusterPlan) -> ClusterNetwork:
    """Every process group ``plan`` needs: per cluster (gradients, parameters, collectives) and one
    for the servers' exchange; a collective: every rank of the job calls it for every plan, in the
    same order, also the ranks outside the plan (the other group of a hybrid job)."""
    if not dist.is_initialized():
        return ClusterNetwork([], None)
    clusters = [ClusterGroups(members, dist.new_group(members), dist.new_group(members), dist.new_group(members))
                for members in plan.clusters]
    return ClusterNetwork(clusters, dist.new_group(sorted(plan.ranks())))
