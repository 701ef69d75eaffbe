"""Joining the job: process group set-up from torchrun's environment variables."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from convoy.errors import UsageError

_ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Set by convoy's own launcher: rank 0's rendezvous store listens on MASTER_ADDR
# only (127.0.0.1 locally), where torch's default would listen on every interface.
BIND_STORE_ENV = "CONVOY_BIND_STORE"


@dataclass(frozen=True)
class Context:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def launched_by_torchrun() -> bool:
    """True when the rendezvous variables of torchrun (or convoy's launcher) are set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE"))


def init(backend: str | None = None, timeout_s: float = 300.0) -> Context:
    """Initialise the default process group from RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    Without those variables this is a world of one (no process group is made).
    gloo on CPU, NCCL when CUDA is available, unless ``backend`` says otherwise.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` for the default of the device.
        timeout_s: how long a collective may wait for a peer before failing;
            a worker that dies makes the others fail within this bound.

    Example::

        >>> ctx = convoy.init()
        >>> print(ctx.rank, ctx.world_size)
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if not launched_by_torchrun():
        return Context(0, 1, 0, device, backend)
    missing = [k for k in _ENV_NEEDED if k not in os.environ]
    if missing:
        raise UsageError(f"environment lacks {', '.join(missing)}; run under torchrun or convoy train --nproc N")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get(BIND_STORE_ENV):
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_bound_store(rank, world, timeout), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return Context(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _bound_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT; on rank 0 it listens on that address alone."""
    import socket

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    listener = socket.create_server((host, port), reuse_port=False, backlog=max(128, world))
    # detach: the store owns the descriptor now; Python must not close it under the store's thread
    return dist.TCPStore(host, port, world, True, timeout, master_listen_fd=listener.detach())


def shutdown() -> None:
    """Leave the job cleanly: wait for every rank, then close the process group.

    Without it each process tears its connections down whenever it exits,
    while a slower peer may still be sending; gloo then aborts that peer.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
