"""Run a function in N real processes joined by a gloo process group."""
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    ``fn`` must be importable (a module-level function) and its result picklable.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args),
                           nprocs=world_size, join=True, start_method="spawn")
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
