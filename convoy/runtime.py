"""Joining the job: process group set-up from torchrun's environment variables."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from convoy.errors import UsageError

_ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Context(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown() -> None:
    """Leave the job cleanly: wait for every rank, then close the process group.

    Without it each process tears its connections down whenever it exits,
    while a slower peer may still be sending; gloo then aborts that peer.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
