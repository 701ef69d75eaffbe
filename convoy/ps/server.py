"""A parameter server's sync strategy: collect the workers' pushes of each layer, send back its parameters.

It is the exchange stage of the engine on a server rank, whose engine trains
the server's :class:`~convoy.ps.job.Shard` and is driven by ``Engine.run_step``
(no forward, no backward). Per layer and step:

1. The workers announce each step; the server then posts every push receive
   of the step at its exact size (:class:`~convoy.ps.push.RowCodec`).
2. The exchange ends when every worker's row of the layer is in; it decodes
   the rows in worker order and averages them (the same sum on every run).
3. The engine's bucket optimizer updates the layer here, where the shard
   lives; the engine's listeners then see it final: first this strategy's
   :class:`Reply`, which queues the layer's parameters to every worker in
   priority order, then a checkpoint's snapshot of the shard.

Under bounded staleness S (colocated servers) a worker pushes step t while the
server may still wait for a slower worker's push of step t - S, so a unit has up
to S + 1 steps outstanding: the inbox keeps S + 1 rows per (worker, unit) and
the outbox S + 1 copies of the parameters being sent, each step in slot
``step % (S + 1)``, and arrivals are counted per step (slices of two steps may
interleave). A slot is reused only after its last use: a worker's push of step
t + S + 1 needs the update of step t, which consumed the rows of step t, and the
update of step t + S + 1 needs every worker's push of that step, which needs the
parameters of step t, fully received.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from convoy.core import Listener, PendingSync, SyncStrategy
from convoy.ps.job import PSJob, Shard
from convoy.ps.progress import ps_waiter
from convoy.ps.push import pieces_within
from convoy.ps.scheduler import SliceScheduler, Transfer, stop_marks
from convoy.ps.slicing import view
from convoy.ps.timeline import Timeline
from convoy.ps.wire import HEADER_BYTES, REPLY_LANE, PostedRecvs, Receiver, StepListener
from convoy.sync.rows import sum_rows


class _Pushes(PendingSync):
    """Every worker's push of ``layer`` at ``step``."""

    def __init__(self, owner: "ServeShard", layer: int, step: int):
        self.owner, self.layer, self.step = owner, layer, step

    def is_done(self) -> bool:
        return (self.layer, self.step) in self.owner._complete

    def wait(self) -> torch.Tensor:
        owner = self.owner
        owner._waiter.wait_for(self.is_done, owner._check_scheduler)
        job, workers = owner.job, owner.job.layer_workers[self.layer]
        width, dtypes, ctx, compressor = job.codec.row(self.layer, job.numel(self.layer), job.shapes(self.layer),
                                                       self.step)
        job.codec.forget(self.layer, self.step)
        rows = [owner._row(worker, self.layer, self.step)[:width] for worker in workers]   # worker order: a fixed sum
        grad = sum_rows(compressor, rows, dtypes, ctx)[0].div_(len(workers))
        with owner._waiter.cond:
            owner._complete.discard((self.layer, self.step))
        owner._update_start[self.layer] = time.time()
        return grad


class ServeShard(SyncStrategy):
    """Serves this rank's shard of the layers to the workers that train them.

    Args:
        job: the job's agreed structure.
        rank: this server's global rank.
        shard: the module its engine trains (``Shard(job, job.layers_of(rank))``).
        timeline: records spans for the Chrome trace, or ``None``.
        scheduler: the sender of its replies; colocated, the one its rank's worker pushes through
            (default: its own). This server closes it.

    Example::

        >>> sync = ServeShard(job, rank, shard)
        >>> engine = Engine(shard, torch.optim.SGD, sync, listeners=sync.listeners(), bucket_bytes=0, lr=0.05)
        >>> engine.run_step()   # step 0's updates run as the workers' pushes arrive
    """

    completes_in_order = False

    def __init__(self, job: PSJob, rank: int, shard: Shard, timeline: Timeline | None = None,
                 scheduler: SliceScheduler | None = None):
        super().__init__()
        self.job, self.rank, self.shard, self.timeline = job, rank, shard, timeline
        self.layers = job.layers_of(rank)
        self.world_size = len(job.layer_workers[self.layers[0]]) if self.layers else 1
        # Colocated, this rank's own worker pushes and pulls in memory (``deliver``, attach_local_worker).
        workers = sorted({w for i in self.layers for w in job.layer_workers[i]} - {rank})
        self._workers = workers
        self._local_worker: Any = None   # colocated: this rank's PushPull, told when its units are updated
        self._local_worker_engine: Any = None   # and its engine
        self._ended = -1                       # the last step whose updates all ran here
        self._waiter = ps_waiter()
        self._slots = job.settings.staleness + 1   # steps a unit may have outstanding
        self._inbox = {(w, i): torch.empty(self._slots, job.push.table[i][-1].offset + job.push.table[i][-1].numel,
                                           dtype=torch.uint8)
                       for i in self.layers for w in job.layer_workers[i] if w != rank}
        self._local_rows: dict[tuple[int, int], torch.Tensor] = {}   # colocated: (unit, step) -> own push row
        self._outbox = {i: torch.empty(self._slots, job.numel(i)) for i in self.layers}   # parameters being sent
        self._arrived: dict[tuple[int, int, int], int] = {}   # (worker, layer, step) -> slices of its push in
        self._done_workers: dict[tuple[int, int], int] = {}   # (layer, step) -> workers whose push is in
        self._complete: set[tuple[int, int]] = set()          # (layer, step) whose pushes are all in
        self._next_step = {i: 0 for i in self.layers}
        self._update_start: dict[int, float] = {}
        channels = job.channels
        self.scheduler = scheduler or SliceScheduler.for_settings(job.settings, f"convoy-ps-reply{rank}")
        self._recvs = PostedRecvs(lambda worker, sid: channels.group(rank, worker, job.push.channel[sid]),
                                  self._push_buffer)
        self._receivers: list[Any] = [
            Receiver(worker, channels.group(rank, worker, c), self._recvs, self._push_handler(worker, c),
                     self._failure(f"worker rank {worker} failed (channel {c})"),
                     name=f"convoy-ps-push{rank}-w{worker}c{c}", ack=channels.ack_group(rank, worker))
            for worker in workers for c in range(channels.count)]
        self._receivers += [
            StepListener(worker, channels.group(rank, worker, 0), self._post_pushes(worker),
                         self._failure(f"worker rank {worker} failed"), name=f"convoy-ps-steps{rank}-w{worker}")
            for worker in workers]
        for receiver in self._receivers:
            receiver.start()

    def attach_local_worker(self, worker: Any, engine: Any) -> None:
        """Colocated: ``worker`` (this rank's :class:`~convoy.ps.worker.PushPull`) pushes to this server in
        memory and is told when its units are updated; its state and ``engine``'s step travel with this
        server's checkpoint."""
        self._local_worker, self._local_worker_engine = worker, engine

    def step_ended(self, step: int) -> None:
        """Every update of ``step`` ran here (the engine's step end)."""
        self._ended = step

    # ---------------------------------------------------- the exchange stage
    def set_step(self, step: int) -> None:
        for layer in self.layers:
            self._next_step[layer] = step
        self._ended = step - 1
        if self._local_worker_engine is not None:   # colocated, resuming: the worker goes on from there too
            self._local_worker_engine.set_step(step)

    def start(self, bucket: Any, grad: torch.Tensor) -> PendingSync:
        layer = self.shard.layer_of[id(bucket.layers[0].module)]
        step = self._next_step[layer]
        self._next_step[layer] = step + 1
        return _Pushes(self, layer, step)

    def next_done(self, pending: Sequence[PendingSync]) -> int:
        self._waiter.wait_for(lambda: any(p.is_done() for p in pending), self._check_scheduler)
        return next(i for i, p in enumerate(pending) if p.is_done())

    def listeners(self) -> list:
        return [Reply(self)]

    # A colocated rank's checkpoint is its server engine's: the state of its worker
    # (error feedback, a compressor's warm start, the step count) travels with it.
    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self._local_worker is None:
            return {}
        # Read at this engine's step end: the worker's state must be that of the same step, all its
        # layers compressed (the worker starts the next step only after this step end).
        self._local_worker_engine.wait_for_step(self._ended)
        return self._local_worker.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._local_worker is not None:
            self._local_worker.load_state_tensors(tensors)

    def state_bytes_bound(self, params_bytes: int) -> int:
        """The worker's bound, for the whole model it trains (``params_bytes`` counts this shard only)."""
        if self._local_worker is None:
            return 0
        model_bytes = sum(4 * self.job.numel(unit) for unit in range(len(self.job.layers)))
        return self._local_worker.state_bytes_bound(max(params_bytes, model_bytes))

    def close(self) -> None:
        """Wait for every worker to end its streams, then end this server's streams."""
        for receiver in self._receivers:
            while receiver.is_alive():
                receiver.join(0.5)
                self._waiter.raise_if_failed()
        channels = self.job.channels
        self.scheduler.submit(mark for worker in self._workers for c in range(channels.count)
                              for mark in stop_marks(worker, channels.group(self.rank, worker, c),
                                                     channels.id(self.rank, worker, c)))
        self.scheduler.close()

    # --------------------------------------------------------------- reply
    def reply(self, layer: int, step: int) -> None:
        """Queue ``layer``'s updated parameters to each of its workers, slice by slice, by priority."""
        start = self._update_start.pop(layer, time.time())
        name = self.job.layers[layer][0]
        if self.timeline is not None:
            self.timeline.span(f"update {name}", "update", "update", start, time.time(), step)
        stale = self._slots > 1
        remote = [worker for worker in self.job.layer_workers[layer] if worker != self.rank]
        flat = self._outbox[layer][(step + 1) % self._slots]   # the parameters of step + 1
        if remote or stale:
            torch.cat([p.detach().reshape(-1) for p in self.shard.params_of[layer]], out=flat)
        if self.rank in self.job.layer_workers[layer]:   # colocated: in place, or (stale) a copy to stage
            self._local_worker.pulled_locally(layer, step, flat if stale else None)
        if not remote:
            return
        channels, pull = self.job.channels, self.job.pull
        transfers = [Transfer(worker, channels.group(self.rank, worker, pull.channel[piece.id]),
                              channels.id(self.rank, worker, pull.channel[piece.id]), piece.id, step,
                              view(flat, piece), self.job.order(pull, piece, self.rank, worker), self._sent,
                              channels.ack_group(self.rank, worker), lane=REPLY_LANE)
                     for worker in remote for piece in pull.table[layer]]
        self._count(sum(t.nbytes for t in transfers), 0)
        self.scheduler.submit(transfers)

    def deliver(self, layer: int, step: int, row: torch.Tensor) -> None:
        """Colocated: this rank's own push of ``layer`` at ``step``, handed over in memory (no copy)."""
        with self._waiter.cond:
            self._local_rows[(layer, step)] = row
            self._worker_done(layer, step)

    def _row(self, worker: int, layer: int, step: int) -> torch.Tensor:
        if worker == self.rank:
            return self._local_rows.pop((layer, step))
        return self._inbox[(worker, layer)][step % self._slots]

    def _worker_done(self, layer: int, step: int) -> None:
        """One more worker's push of ``layer`` at ``step`` is complete (the caller holds the condition)."""
        key = (layer, step)
        self._done_workers[key] = self._done_workers.get(key, 0) + 1
        if self._done_workers[key] == len(self.job.layer_workers[layer]):
            del self._done_workers[key]
            self._complete.add(key)
            self._waiter.cond.notify_all()

    # ------------------------------------------------------- helper threads
    def _push_buffer(self, worker: int, slice_id: int, step: int) -> torch.Tensor:
        piece = self.job.push.slice(slice_id)
        width = self._width(piece.layer, step)
        row = self._inbox[(worker, piece.layer)][step % self._slots]
        return row.narrow(0, piece.offset, min(piece.numel, width - piece.offset))

    def _width(self, layer: int, step: int) -> int:
        return self.job.codec.row(layer, self.job.numel(layer), self.job.shapes(layer), step)[0]

    def _post_pushes(self, worker: int) -> Callable[[int], None]:
        def on_step(step: int) -> None:
            # Posted before the worker's backward: its pushes never wait for a receive.
            for layer in self.layers:
                if worker in self.job.layer_workers[layer]:
                    for piece, _ in pieces_within(self.job.push.table[layer], self._width(layer, step)):
                        self._recvs.post(worker, piece.id, step)
        return on_step

    def _push_handler(self, worker: int, channel: int) -> Callable[[int, int, float], None]:
        track = f"push ch{self.job.channels.id(self.rank, worker, channel)} <- w{worker}"

        def on_slice(slice_id: int, step: int, started: float) -> None:
            piece = self.job.push.slice(slice_id)
            layer = piece.layer
            width = self._width(layer, step)
            nbytes = HEADER_BYTES + min(piece.numel, width - piece.offset)
            self._count(0, nbytes)
            if self.timeline is not None:
                self.timeline.span(f"push {self.job.layers[layer][0]}[{piece.part}]", "push", track, started,
                                   time.time(), step, bytes=nbytes)
            expected = len(pieces_within(self.job.push.table[layer], width))
            with self._waiter.cond:
                key = (worker, layer, step)
                self._arrived[key] = self._arrived.get(key, 0) + 1
                if self._arrived[key] < expected:
                    return
                del self._arrived[key]
                self._worker_done(layer, step)
        return on_slice

    def _check_scheduler(self) -> None:
        if self.scheduler.error is not None:
            self._waiter.fail("sending parameters failed", self.scheduler.error)

    def _sent(self, transfer: Transfer, issued: float, done: float) -> None:
        if self.timeline is not None and transfer.payload is not None:
            piece = self.job.pull.slice(transfer.slice_id)
            self.timeline.span(f"pull {self.job.layers[piece.layer][0]}[{piece.part}]", "pull",
                               f"pull ch{transfer.channel} -> w{transfer.peer}", issued, done, transfer.step + 1,
                               bytes=transfer.nbytes, priority=list(transfer.priority))

    def _failure(self, message: str) -> Callable[[BaseException], None]:
        return lambda exc: self._waiter.fail(message, exc)


class Reply(Listener):
    """The server engine's first listener: a layer's update is final, send it to the workers."""

    def __init__(self, serve: ServeShard):
        self.serve = serve

    def on_layer_updated(self, layer: Any, step: int) -> None:
        self.serve.reply(self.serve.shard.layer_of[id(layer.module)], step)

    def on_step_end(self, step: int, stats: Any) -> None:
        self.serve.step_ended(step)
