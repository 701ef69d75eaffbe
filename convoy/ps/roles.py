"""Who serves and who trains: the first S ranks are servers, the other W ranks workers."""
from __future__ import annotations

from dataclasses import dataclass

from convoy.errors import UsageError


@dataclass(frozen=True)
class PSRoles:
    """S servers (ranks 0..S-1) and W workers (ranks S..S+W-1).

    Example::

        >>> roles = PSRoles(servers=2, world_size=5)
        >>> roles.workers, roles.is_server(1), roles.worker_index(3)
        ([2, 3, 4], True, 1)
    """

    servers: int
    world_size: int

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise UsageError(f"--servers must be >= 1, got {self.servers}")
        if self.servers >= self.world_size:
            raise UsageError(f"--servers ({self.servers}) must be smaller than the number of processes "
                             f"({self.world_size}): at least one rank must train as a worker")

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.servers))

    @property
    def workers(self) -> list[int]:
        return list(range(self.servers, self.world_size))

    @property
    def num_workers(self) -> int:
        return self.world_size - self.servers

    @property
    def first_worker(self) -> int:
        return self.servers

    def is_server(self, rank: int) -> bool:
        return rank < self.servers

    def worker_index(self, rank: int) -> int:
        """Position of worker ``rank`` among the workers (its data rank)."""
        if self.is_server(rank):
            raise ValueError(f"rank {rank} is a server")
        return rank - self.servers
