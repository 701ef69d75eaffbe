"""Flat data parallelism: every layer's gradient is all-reduced and averaged."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy.compress import Compressor, IdentityCompressor, Memory, NoMemory
from convoy.engine.layers import Bucket
from convoy.sync.base import Done, PendingSync, SyncStrategy


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``.

    Reduce-scatter then all-gather: 2 (N - 1) chunks of nbytes / N each.
    """
    return 2 * (world_size - 1) * nbytes // world_size


class _PendingAllReduce(PendingSync):
    def __init__(self, work: Any, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish

    def is_done(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._finish()


class AllReduce(SyncStrategy):
    """Asynchronous all-reduce of each layer's (compressed) gradient, then average.

    Args:
        group: the process group to average over; ``None`` is the default group.
            Give the engine a group of its own so its collectives never interleave
            with the training loop's.
        compressor: must be summable (payloads added element-wise on the wire).
        memory: error-feedback memory for what the compressor loses.

    Example::

        >>> strategy = AllReduce(dist.new_group())
    """

    def __init__(self, group: dist.ProcessGroup | None = None,
                 compressor: Compressor | None = None, memory: Memory | None = None):
        super().__init__()
        self.compressor = compressor or IdentityCompressor()
        if not self.compressor.summable:
            raise ValueError(f"{type(self.compressor).__name__} payloads cannot be summed; "
                             "all-reduce needs a summable compressor")
        self.memory = memory or NoMemory()
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1

    def start(self, bucket: Bucket, grad: torch.Tensor) -> PendingSync:
        name = str(bucket.index)
        compensated = self.memory.compensate(grad, name)
        payload, ctx = self.compressor.compress(compensated, name)
        self.memory.update(compensated, name, self.compressor.decompress(payload, ctx))
        if self.world_size == 1:
            return Done(self.compressor.decompress(payload, ctx))
        (wire,) = payload
        work = dist.all_reduce(wire, group=self.group, async_op=True)
        moved = ring_allreduce_bytes(wire.numel() * wire.element_size(), self.world_size)
        self._count(moved, moved)

        def finish() -> torch.Tensor:
            return self.compressor.decompress([wire], ctx).div_(self.world_size)

        return _PendingAllReduce(work, finish)
