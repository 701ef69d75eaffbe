"""Run a function in N local processes joined by a gloo process group (tests, benchmarks)."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    """One rank of a local world: join the gloo group on loopback ``port``, run ``fn(rank, world, *args)``
    and write its result to ``out_dir/<rank>.pkl`` (the entry point ``run_in_processes`` starts)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(fn(rank, world, *args)))
        # Rank 0 holds the store that new groups rendezvous through: it must not exit while a rank
        # that is still creating one (a group rank 0 is not in) needs it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_in_processes(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return their results.

    Each process has a gloo default group over loopback and one torch thread.
    ``fn`` must be importable (defined at module level) and return something picklable.

    Example::

        >>> def rank_times_two(rank, world):
        ...     return rank * 2
        >>> run_in_processes(rank_times_two, 2)
        [0, 2]
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(rank_entry, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
