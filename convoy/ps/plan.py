"""One priority plan for the whole job: traced and timed on the first worker, then broadcast.

Measured run times differ from rank to rank, and the maps decide which
channel a slice travels on, so both ends of a channel must use the same plan.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from convoy.ps.priority import PriorityPlan, graph_priorities, timed_priorities
from convoy.ps.roles import PSRoles
from convoy.ps.trace_graph import trace

_PROBE_BYTES = 1 << 20
_PROBES = 3


def agree_on_plan(model: nn.Module, roles: PSRoles, rank: int, mode: str, example: torch.Tensor) -> PriorityPlan:
    """The priority plan every rank uses; a collective over the default group.

    The first worker traces ``model`` on ``example`` (a batch like the training
    batches); for ``timed`` it also measures the bandwidth to server 0, and
    counts a 1/W share of it per worker, since W workers share the server's link.
    FIFO gets the graph plan: it only uses it to map slices to channels.
    """
    bandwidth = measure_bandwidth(roles, rank) if mode == "timed" else None
    plan: list[PriorityPlan | None] = [None]
    if rank == roles.first_worker:
        graph = trace(model, example)
        if mode == "timed":
            plan[0] = timed_priorities(graph, bandwidth / roles.num_workers)
        else:
            plan[0] = graph_priorities(graph)
    dist.broadcast_object_list(plan, src=roles.first_worker)
    return plan[0]


def measure_bandwidth(roles: PSRoles, rank: int) -> float | None:
    """Bytes per second from the first worker to server 0 (best of a few 1 MB sends); None elsewhere.
    Colocated, rank 0 is both: it measures its link to rank 1."""
    worker = roles.first_worker
    server = 1 if worker == 0 else 0
    if rank not in (worker, server):
        return None
    payload = torch.zeros(_PROBE_BYTES // 4)
    ack = torch.zeros(1)
    best = float("inf")
    for _ in range(_PROBES):
        if rank == worker:
            start = time.perf_counter()
            dist.send(payload, server)
            dist.recv(ack, server)
            best = min(best, time.perf_counter() - start)
        else:
            dist.recv(payload, worker)
            dist.send(ack, worker)
    return _PROBE_BYTES / best if rank == worker else None
