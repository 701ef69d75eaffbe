"""The job's shape: how many ranks, which role each plays, who reads data, which ranks share an engine.

Computed and checked once, up front (from the configuration and the world
size by ``TrainConfig.job_shape``, before any worker starts and again in
every worker; this module knows nothing of the configuration), and handed to
everything that used to work it out for itself: the data sampler (how many
ranks split a global batch), the layouts (roles), hierarchical sync (the
groups it clusters), and :meth:`convoy.parallel.groups.ProcessGroups.create`,
which makes the job's process groups from it, once. As torchtitan's
``ParallelDims``: one frozen value, so two parts of the code can never
disagree about the job.

Example::

    >>> shape = JobShape(world_size=5, conv_workers=4, fc_workers=1, clusters=2)
    >>> shape.data_world_size, shape.engine_groups, shape.clusters_in([4])
    (4, [[0, 1, 2, 3], [4]], 1)
"""
from __future__ import annotations

from dataclasses import dataclass

from convoy.errors import UsageError
from convoy.parallel.hybrid import HybridRoles
from convoy.ps.roles import PSRoles


@dataclass(frozen=True)
class JobShape:
    """Roles and groups of a job of ``world_size`` ranks.

    Args:
        world_size: the job's processes.
        servers: ``--sync ps``: S ranks serve parameters and read no data (0: none):
            ranks 0..S-1, or in a hybrid job the last S ranks.
        conv_workers, fc_workers: ``--parallel hybrid``: I conv workers (ranks
            0..I-1) and J FC workers (ranks I..I+J-1); 0 and 0: data parallelism.
        clusters: ``--sync hierarchical``: K clusters in every engine group of
            more than one rank, or ``"auto"``; 1 without hierarchical sync.

    Raises:
        UsageError: one line naming the setting that does not fit the world.
    """

    world_size: int
    servers: int = 0
    conv_workers: int = 0
    fc_workers: int = 0
    clusters: int | str = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"a job needs at least one process, got {self.world_size}")
        if self.servers and not self.hybrid:
            self.ps_roles()   # its own checks
        if self.hybrid:
            roles = HybridRoles(self.conv_workers, self.fc_workers)   # its own checks
            if self.servers + roles.world_size != self.world_size:
                servers = " + --servers" if self.servers else ""
                raise UsageError(f"--conv-workers + --fc-workers{servers} = {self.servers + roles.world_size} "
                                 f"but the job has {self.world_size} processes")
        if self.clusters != "auto":
            for group, name in zip(self.engine_groups, self._group_names()):
                if len(group) > 1 and int(self.clusters) > len(group):
                    raise UsageError(f"--clusters {self.clusters} is more than the {len(group)} {name}")

    # ------------------------------------------------------------------ roles
    @property
    def hybrid(self) -> bool:
        return bool(self.conv_workers or self.fc_workers)

    def hybrid_roles(self) -> HybridRoles:
        return HybridRoles(self.conv_workers, self.fc_workers)

    def ps_roles(self) -> PSRoles:
        return PSRoles(self.servers, self.world_size)

    @property
    def workers(self) -> list[int]:
        """The ranks that read training data: conv workers, or every rank but the servers."""
        if self.hybrid:
            return self.engine_groups[0]
        return list(range(self.servers, self.world_size))

    @property
    def data_world_size(self) -> int:
        """Ranks that split every global batch."""
        return len(self.workers)

    def data_rank(self, rank: int) -> int:
        """Which part of a global batch ``rank`` reads (ranks that read none pace the loop with part 0)."""
        workers = self.workers
        return workers.index(rank) if rank in workers else 0

    # ----------------------------------------------------------------- groups
    @property
    def engine_groups(self) -> list[list[int]]:
        """The ranks of each engine's group, whose gradients are averaged together."""
        if self.hybrid:
            fc = self.conv_workers
            return [list(range(fc)), list(range(fc, fc + self.fc_workers))]
        return [list(range(self.world_size))]

    def group_of(self, rank: int) -> list[int]:
        return next(group for group in self.engine_groups if rank in group)

    def clusters_in(self, group: list[int]) -> int | str:
        """K for ``group``: the job's, except that a group of one rank is one cluster."""
        return 1 if len(group) == 1 else self.clusters

    def _group_names(self) -> list[str]:
        return ["conv workers", "FC workers"] if self.hybrid else ["nodes"]

