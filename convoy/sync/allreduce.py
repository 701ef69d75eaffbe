"""Flat data parallelism: every layer's gradient is all-reduced (or, compressed, all-gathered) and averaged."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from convoy.compress import Compressor, LayerInfo, Memory, Place, Support
from convoy.core import Replay
from convoy.sync.base import Done, PendingSync, SyncStrategy
from convoy.sync.pipeline import WARMUP_START_DENSITY, CompressionPipeline
from convoy.sync.rows import pack_row, row_extent, sum_rows
from convoy.utils.collective import AsyncCollective

__all__ = ["WARMUP_START_DENSITY", "AllReduce", "ring_allreduce_bytes"]


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``.

    Reduce-scatter then all-gather: 2 (N - 1) chunks of nbytes / N each.
    """
    return 2 * (world_size - 1) * nbytes // world_size


class _PendingAllReduce(PendingSync):
    """``finish`` turns what the collective received into the average and its support; ``finite``,
    where given, says from what was received whether the average is certainly finite."""

    def __init__(self, sent: AsyncCollective, finish: Callable[[], tuple[torch.Tensor, Support | None]],
                 finite: Callable[[], bool] | None = None):
        self._sent = sent
        self._finish = finish
        self._finite = finite

    def is_done(self) -> bool:
        return self._sent.is_completed()

    def wait(self) -> torch.Tensor:
        self._sent.wait()
        return self._average()

    def _average(self) -> torch.Tensor:
        average, self.support = self._finish()
        self.finite = self._finite is not None and self._finite()
        return average


class _PendingRounds(PendingSync):
    """An exchange whose intermediate round is being summed (PowerSGD's ``P``, all-reduced in place);
    :meth:`advance` waits for the sum and runs the rest (``rest(summed payload)``: the next rounds
    and the final exchange)."""

    def __init__(self, sums: list[AsyncCollective], payload: list[torch.Tensor],
                 rest: Callable[[list[torch.Tensor]], PendingSync]):
        self._sums, self._payload, self._rest = sums, payload, rest
        self._final: PendingSync | None = None

    def advance(self) -> None:
        if self._final is None:
            for summed in self._sums:
                summed.wait()
            self._final = self._rest(self._payload)

    def is_done(self) -> bool:
        return self._final is not None and self._final.is_done()

    def wait(self) -> torch.Tensor:
        self.advance()
        average = self._final.wait()
        self.support, self.finite = self._final.support, self._final.finite
        return average


class AllReduce(SyncStrategy):
    """Asynchronous exchange of each layer's (compressed) gradient, then average.

    Summable payloads (no compression, fp16, randomk, globally chosen blocks)
    are all-reduced. Payloads that differ between ranks (element-wise top-k,
    locally chosen blocks) are all-gathered, each padded to a width every rank
    knows (the compressor's bound, else the largest payload, agreed first),
    then each decompressed and the results summed in rank order, so every rank
    computes the identical average.

    Args:
        group: the process group to average over; ``None`` is the default group.
            Give the engine a group of its own so its collectives never interleave
            with the training loop's.
        compressor: how a layer's gradient is put on the wire.
        memory: error-feedback memory for what the compressor loses.
        warmup_steps: ramp a sparse compressor's density down over the first
            this many steps, exponentially from 25% to its own (DGC's warm-up);
            a compressor without a density (fp16, a fixed block count) sends
            them uncompressed instead.
        pipeline: or all three as a :class:`~convoy.sync.pipeline.CompressionPipeline`
            (a DDP hook's state keeps its own across the exchanges it builds).

    Example::

        >>> group = ProcessGroups.create(JobShape(dist.get_world_size())).engines[0]   # on every rank
        >>> strategy = AllReduce(group)
        >>> sparse = AllReduce(group, BlockTopKCompressor(1), ResidualMemory())
    """

    # Whether the final payload goes to a receiver that took no part in the
    # rounds (LayerInfo.remote): a parameter-server push.
    remote_payloads = False
    # Whether ``start`` leaves a compressor's first intermediate round (PowerSGD's P) in flight for
    # PendingSync.advance. A strategy whose final exchange reads what the latest start set
    # (hierarchical sync: the step's server) turns it off: its rounds block in start.
    defers_rounds = True

    def __init__(self, group: dist.ProcessGroup | None = None,
                 compressor: Compressor | None = None, memory: Memory | None = None,
                 warmup_steps: int = 0, *, pipeline: CompressionPipeline | None = None):
        super().__init__()
        if pipeline is not None and (compressor is not None or memory is not None or warmup_steps):
            raise ValueError("give a pipeline or its compressor, memory and warmup_steps, not both")
        self.pipeline = pipeline or CompressionPipeline(compressor, memory, warmup_steps)
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._exchanges: dict[int, int] = {}  # bucket index -> steps exchanged
        self._first_step = 0

    @property
    def compressor(self) -> Compressor:
        return self.pipeline.compressor

    @property
    def memory(self) -> Memory:
        return self.pipeline.memory

    @property
    def warmup_steps(self) -> int:
        return self.pipeline.warmup_steps

    def set_step(self, step: int) -> None:
        """Count steps from ``step`` (resuming): warm-up covers steps ``< warmup_steps`` of the job."""
        self._first_step = step
        self._exchanges.clear()

    def start_replay(self, replay: Replay) -> None:
        """Take the averages of the steps ``replay`` covers from it: the memory moves on as in
        training, nothing crosses the network (a resume's replay, :mod:`convoy.checkpoint.replay`)."""
        self.pipeline.start_replay(replay)

    def stop_replay(self) -> None:
        self.pipeline.stop_replay()

    def warmup_density(self, step: int) -> float | None:
        """The least share of each layer sent at ``step``: 25% decaying exponentially to the
        compressor's density over the warm-up, then None (the compressor's own).

        Example::

            >>> AllReduce(None, TopKCompressor(0.01), warmup_steps=2).warmup_density(1)
            0.05
        """
        return self.pipeline.warmup_density(step)

    def start(self, bucket: Any, grad: torch.Tensor) -> PendingSync:
        # The parameters one by one: the memory reads them in place, no flat copy per step.
        params = [p.detach() for p in bucket.params] if self.pipeline.needs_params else None
        layers = tuple(layer.name for layer in bucket.layers) if self.pipeline.replaying else None
        return self.start_flat(bucket.index, tuple(p.shape for p in bucket.params), grad, params, layers,
                               defer_rounds=self.defers_rounds)

    def start_flat(self, index: int, shapes: tuple[torch.Size, ...], grad: torch.Tensor,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None,
                   layers: tuple[str, ...] | None = None, defer_rounds: bool = False) -> PendingSync:
        """Begin exchanging ``grad``, the concatenated gradients of parameters of ``shapes``.

        ``index`` names the bucket, the same on every rank (error feedback and
        warm-up are kept per index); callers that have no engine ``Bucket``
        (a DDP comm hook) use this entry. ``grad`` is the exchange's to
        overwrite: the average may be built in it (uncompressed it is summed
        in place, PowerSGD decompresses into it). ``params`` are the bucket's
        parameters (flat, or each tensor in order), needed only when the error
        memory asks for them (momentum correction adds weight decay). ``layers`` names the bucket's
        layers for a replay (:meth:`start_replay`). ``defer_rounds``: a compressor's intermediate round
        (PowerSGD's ``P``) is all-reduced asynchronously and the rest of the exchange waits
        for :meth:`PendingSync.advance` (its sum is taken there); otherwise the rounds block here.
        """
        step = self._exchanges.get(index, self._first_step)
        self._exchanges[index] = step + 1
        name = str(index)
        # A compressor without a density warms up dense; the memory still runs,
        # so momentum correction keeps its velocity through the warm-up.
        compressor = self.pipeline.compressor_at(step)
        compensated = self.pipeline.compensate(grad, name, params)
        info = LayerInfo(shapes=shapes, agree=self._agree, step=step, density=self.warmup_density(step),
                         world_size=self.world_size, remote=self.remote_payloads)
        payload, ctx = compressor.compress(compensated, name, info)

        def rest(summed: list[torch.Tensor]) -> PendingSync:   # after the deferred round's sum
            return self._last_round(compressor, *compressor.next_round(summed, ctx), compensated, name, step,
                                    layers, grad)

        if defer_rounds and self.world_size > 1 and compressor.more_rounds(ctx):
            return _PendingRounds([self._agree_async(t) for t in payload], payload, rest)
        return self._last_round(compressor, payload, ctx, compensated, name, step, layers, grad)

    def _last_round(self, compressor: Compressor, payload: Any, ctx: Any, compensated: torch.Tensor, name: str,
                    step: int, layers: tuple[str, ...] | None, grad: torch.Tensor) -> PendingSync:
        """The rounds left (each summed now, blocking), error feedback, and the final exchange."""
        while compressor.more_rounds(ctx):   # PowerSGD's P: summed now, the last round below
            payload, ctx = compressor.next_round([self._agree(t) for t in payload], ctx)
        self.pipeline.keep_unsent(compensated, name, compressor, payload, ctx)
        logged = self.pipeline.replayed(step, layers)
        if logged is not None:
            # A resume replaying a logged step: the memory moved on as in training; the
            # average the ranks computed then is in the log, so nothing crosses the network.
            return Done(logged.to(grad.device))   # the log is read on the CPU
        return self._exchange(compressor, payload, ctx, grad)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.pipeline.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pipeline.load_state_tensors(tensors)

    def state_bytes_bound(self, params_bytes: int) -> int:
        return self.pipeline.state_bytes_bound(params_bytes)

    def replaced_each_step(self) -> tuple[str, ...]:
        return self.pipeline.replaced_each_step()

    def place_state_in(self, place: Place | None) -> None:
        self.pipeline.place_state_in(place)

    def _exchange(self, compressor: Compressor, payload: Any, ctx: Any,
                  out: torch.Tensor | None = None) -> PendingSync:
        """Exchange the final payload; ``out`` (the exchanged gradient, or None) may receive the average."""
        if self.world_size == 1:
            total, support = compressor.decompress_sum([payload], ctx)
            # A host-coded payload (run lengths) decodes on the CPU; the average goes where the gradient is.
            return Done(total if out is None else total.to(out.device), support)
        if compressor.summable:
            return self._all_reduce(compressor, payload, ctx, out)
        return self._all_gather(compressor, payload, ctx, None if out is None else out.device)

    def _all_reduce(self, compressor: Compressor, payload: list[torch.Tensor], ctx: Any,
                    out: torch.Tensor | None = None) -> PendingSync:
        (wire,) = payload
        sent = AsyncCollective(wire, lambda: dist.all_reduce(wire, group=self.group, async_op=True))
        moved = ring_allreduce_bytes(wire.numel() * wire.element_size(), self.world_size)
        self._count(moved, moved)

        def finish() -> tuple[torch.Tensor, Support | None]:
            if out is None:
                total, support = compressor.decompress_sum([[wire]], ctx)
                return total.div_(self.world_size), support
            return compressor.decompress_mean_into([[wire]], ctx, out, self.world_size)

        return _PendingAllReduce(sent, finish, lambda: compressor.certainly_finite([wire], ctx))

    def _all_gather(self, compressor: Compressor, payload: list[torch.Tensor], ctx: Any,
                    device: torch.device | None = None) -> PendingSync:
        # Each rank's row (convoy.sync.rows), padded to a width every rank agrees on.
        dtypes = [t.dtype for t in payload]
        head, used = row_extent(payload)
        width = self._row_width(compressor, ctx, head, used)
        mine = pack_row(payload, width)
        rows = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        sent = AsyncCollective(mine, lambda: dist.all_gather(rows, mine, group=self.group, async_op=True))
        moved = (self.world_size - 1) * width
        self._count(moved, moved)

        def finish() -> tuple[torch.Tensor, Support | None]:
            total, support = sum_rows(compressor, rows, dtypes, ctx, device)
            return total.div_(self.world_size), support

        return _PendingAllReduce(sent, finish)

    def _row_width(self, compressor: Compressor, ctx: Any, head: int, used: int) -> int:
        """Bytes of every rank's all-gather row: the compressor's bound, or the largest payload."""
        bound = compressor.max_payload_bytes(ctx)
        if bound is not None:
            if used > head + bound:
                raise RuntimeError(f"{type(compressor).__name__} payload of {used - head} bytes "
                                   f"exceeds its bound of {bound}")
            return head + bound
        # No bound: agree on the largest size first (one small blocking all-reduce).
        largest = torch.tensor([used], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        moved = ring_allreduce_bytes(largest.element_size(), self.world_size)
        self._count(moved, moved)
        return int(largest)

    def _agree_async(self, tensor: torch.Tensor) -> AsyncCollective:
        """Start summing ``tensor`` over the group in place; what to wait on."""
        moved = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self._count(moved, moved)
        return AsyncCollective(tensor, lambda: dist.all_reduce(tensor, group=self.group, async_op=True))

    def _agree(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, blocking (block scores of a global selection)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
            moved = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
            self._count(moved, moved)
        return tensor
