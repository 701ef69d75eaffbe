"""Who serves and who trains: S server ranks (the first S, or the last S), the other W ranks workers;
or, colocated, every rank both serves a shard and trains."""
from __future__ import annotations

from dataclasses import dataclass

from convoy.errors import UsageError


@dataclass(frozen=True)
class PSRoles:
    """S servers (ranks 0..S-1) and W workers (ranks S..S+W-1); with ``servers_last`` the
    servers are ranks W..W+S-1 instead (a hybrid job keeps its conv and FC ranks first).

    Example::

        >>> roles = PSRoles(servers=2, world_size=5)
        >>> roles.workers, roles.is_server(1), roles.worker_index(3)
        ([2, 3, 4], True, 1)
        >>> PSRoles(1, 4, servers_last=True).server_ranks
        [3]
    """

    servers: int
    world_size: int
    servers_last: bool = False
    colocated: bool = False

    @classmethod
    def colocate(cls, world_size: int) -> "PSRoles":
        """Every one of ``world_size`` ranks serves a shard and trains (``--servers colocated``).

        Example::

            >>> roles = PSRoles.colocate(3)
            >>> roles.server_ranks == roles.workers == [0, 1, 2]
            True
        """
        if world_size < 2:
            raise UsageError(f"--servers colocated needs at least 2 processes, got {world_size}; "
                             "train on one process without --sync ps")
        return cls(world_size, world_size, colocated=True)

    def __post_init__(self) -> None:
        if self.colocated:
            return
        if self.servers < 1:
            raise UsageError(f"--servers must be >= 1, got {self.servers}")
        if self.servers >= self.world_size:
            raise UsageError(f"--servers ({self.servers}) must be smaller than the number of processes "
                             f"({self.world_size}): at least one rank must train as a worker")

    @property
    def _first_server(self) -> int:
        return self.world_size - self.servers if self.servers_last else 0

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self._first_server, self._first_server + self.servers))

    @property
    def workers(self) -> list[int]:
        if self.colocated:
            return list(range(self.world_size))
        return [r for r in range(self.world_size) if not self.is_server(r)]

    @property
    def num_workers(self) -> int:
        return self.world_size if self.colocated else self.world_size - self.servers

    @property
    def first_worker(self) -> int:
        return self.workers[0]

    def is_server(self, rank: int) -> bool:
        return self._first_server <= rank < self._first_server + self.servers

    def server_index(self, rank: int) -> int:
        """Position of server ``rank`` among the servers."""
        if not self.is_server(rank):
            raise ValueError(f"rank {rank} is not a server")
        return rank - self._first_server

    def worker_index(self, rank: int) -> int:
        """Position of worker ``rank`` among the workers (its data rank)."""
        if self.colocated:
            return rank
        if self.is_server(rank):
            raise ValueError(f"rank {rank} is a server")
        return self.workers.index(rank)
