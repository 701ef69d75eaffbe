"""A parameter-server worker's sync strategy: push each layer's compressed gradient, pull its parameters.

It is the exchange stage of the engine (:mod:`convoy.engine.engine`) on a
worker. Compression and error feedback are all-reduce's own (this class
extends :class:`~convoy.sync.allreduce.AllReduce` and replaces only the
exchange): the compressed payload goes out as a row (:mod:`convoy.ps.push`),
cut into slices that the scheduler sends by priority within its credit, on
the channel the routing gives each slice. The exchange ends when the layer's
updated parameters are back from its server (pulled slices land in a staging
vector per layer); the engine copies them in, and the next forward's
pre-hook on the layer waits only for that.

Bounded staleness S (colocated servers): the exchange of step t ends with the
parameters of step t + 1 - S (the server's update of step t - S) copied in, so
the forward of step t + 1 runs on them: a fixed delay, the same on every run,
and a worker runs at most S steps ahead of the slowest. Each unit stages S + 1
versions (the update of step k in slot ``(k + 1) % (S + 1)``), its own units
too (their server updates a copy, :class:`~convoy.ps.job.Shard`); a slot is
posted for the update of step t at the push of step t, after the exchange of
step t - 1 installed what it held. ``newest_parameters`` puts the servers'
latest parameters in place for evaluation and saving.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from convoy.compress import Compressor, Memory
from convoy.core import PendingSync, SyncStrategy
from convoy.ps.job import PSJob
from convoy.errors import peer_lost
from convoy.ps.progress import PSError, ps_waiter
from convoy.ps.push import no_agreement, pieces_within, wire_width
from convoy.ps.scheduler import SliceScheduler, Transfer, TransferError, stop_marks
from convoy.ps.slicing import view
from convoy.ps.timeline import Timeline
from convoy.ps.wire import HEADER_BYTES, REPLY_LANE, REPORT_TAG, STEP_TAG, PostedRecvs, Receiver
from convoy.sync.allreduce import AllReduce
from convoy.sync.rows import pack_row

# How long a rank that lost a peer waits for its receivers to name the dead server (they see it at once).
SERVER_FAILURE_GRACE_S = 2.0


class _Pull(PendingSync):
    """A pushed layer of ``step``; the exchange ends with its units' update of ``step - staleness``
    (before the first step: with nothing, the initial parameters stay)."""

    def __init__(self, owner: "PushPull", units: Sequence[int], step: int):
        self.owner, self.units, self.update = owner, units, step - owner.staleness

    def is_done(self) -> bool:
        return all(self.owner._pulled[unit] >= self.update for unit in self.units)

    def wait(self) -> torch.Tensor | None:
        """The layer's parameters (one unit from a server), else None: the units are in place already
        (colocated: a rank's own units were updated in place, the others are copied in here)."""
        owner = self.owner
        owner._waiter.wait_for(self.is_done, owner._check_scheduler)
        if self.update < 0:
            return None
        staged = [unit for unit in self.units if unit in owner._staging]
        if len(self.units) == 1 and staged:
            return owner._version(staged[0], self.update + 1)
        for unit in staged:
            _copy_into(owner.job.layers[unit][2], owner._version(unit, self.update + 1))
        return None


class PushPull(AllReduce):
    """Push gradients to the layers' servers and return the parameters they send back.

    Args:
        job: the job's agreed structure (channels, routings, layer workers).
        rank: this worker's global rank.
        model: the module this worker trains (the whole model, or a hybrid part);
            its layers get forward hooks that announce each training step to the servers.
        compressor, memory, warmup_steps: as for :class:`AllReduce`.
        timeline: records spans for the Chrome trace, or ``None``.
        agreement_group: the workers that push this model's layers (every one of
            them, nothing else), for compressors that agree before they push:
            PowerSGD's P round and warm start are summed over it. ``None``: a
            compressor that needs agreement is refused.
        scheduler: the sender of its pushes; colocated, the one its rank's server
            replies through, so the rank's link has one priority queue and one
            credit window (default: its own, which this worker closes).

    Example::

        >>> sync = PushPull(job, rank, model, BlockTopKCompressor(fraction=0.1), ResidualMemory())
        >>> engine = Engine(model, torch.optim.SGD, sync, bucket_bytes=0, lr=0.05)
    """

    returns_parameters = True
    completes_in_order = False
    remote_payloads = True

    def __init__(self, job: PSJob, rank: int, model: nn.Module, compressor: Compressor | None = None,
                 memory: Memory | None = None, warmup_steps: int = 0, timeline: Timeline | None = None,
                 agreement_group: dist.ProcessGroup | None = None, scheduler: SliceScheduler | None = None):
        super().__init__(agreement_group, compressor, memory, warmup_steps)
        self.job, self.rank, self.timeline = job, rank, timeline
        mine = [i for i, workers in enumerate(job.layer_workers) if rank in workers]
        self.world_size = len(job.layer_workers[mine[0]]) if mine else 1   # workers averaged over
        # Colocated, this rank's own server takes its pushes in memory and updates its units in place.
        self._servers = sorted({job.server_of(i) for i in mine} - {rank})
        self._local_server: Any = None          # colocated: this rank's ServeShard (attach_local_server)
        self._local_server_engine: Any = None   # and its engine, closed between this worker's two halves
        self._waiter = ps_waiter()
        self.staleness = job.settings.staleness
        # Versions of the parameters per unit (S + 1 of them); a rank's own units only when stale,
        # else its server updates them in place.
        self._staging = {i: torch.empty(self.staleness + 1, job.numel(i)) for i in mine
                         if job.server_of(i) != rank or self.staleness}
        self._arrived: dict[tuple[int, int], int] = {}    # (unit, step) -> slices of its pull that are in
        self._pulled = {i: -1 for i in mine}              # the steps up to this one are pulled, per unit
        self._pulled_ahead: dict[int, set[int]] = {i: set() for i in mine}   # pulled before an earlier step
        self._last_step = -1                              # the last step pushed
        self._current: tuple[int, int] = (-1, -1)         # (layer, step) being exchanged
        self._announced = -1
        self._announce_lock = threading.Lock()   # the main thread's forward and the engine's thread both announce
        self._announcements: list[Any] = []
        self._reports: list[Any] = []
        channels = job.channels
        self._owns_scheduler = scheduler is None
        self.scheduler = scheduler or SliceScheduler.for_settings(job.settings, f"convoy-ps-push{rank}")
        self._recvs = PostedRecvs(lambda server, sid: channels.group(server, rank, job.pull.channel[sid]),
                                  lambda server, sid, step: self._buffer_of(sid, step))
        self._receivers = [
            Receiver(server, channels.group(server, rank, c), self._recvs, self._pull_handler(server, c),
                     self._failure(f"parameter server rank {server} failed (channel {c})"),
                     name=f"convoy-ps-pull{rank}-s{server}c{c}", ack=channels.ack_group(server, rank),
                     lane=REPLY_LANE)
            for server in self._servers for c in range(channels.count)]
        for receiver in self._receivers:
            receiver.start()
        self._handles = [module.register_forward_hook(self._announce_hook(self.job.index_of[id(module)]))
                         for module in model.modules() if id(module) in self.job.index_of]
        if timeline is not None:
            self._handles += self._compute_hooks(model)

    def attach_local_server(self, server: Any, engine: Any) -> None:
        """Colocated: push this rank's own units to ``server`` (its :class:`~convoy.ps.server.ServeShard`)
        in memory; ``engine``, the server's, is closed between this worker's two halves."""
        self._local_server, self._local_server_engine = server, engine

    # ---------------------------------------------------- the exchange stage
    # A push to a server cannot be replayed from a checkpoint's log.
    start_replay = SyncStrategy.start_replay

    def set_step(self, step: int) -> None:
        super().set_step(step)
        self._announced = self._last_step = step - 1
        for layer in self._pulled:
            self._pulled[layer] = step - 1
            self._pulled_ahead[layer].clear()

    def start(self, bucket: Any, grad: torch.Tensor) -> PendingSync:
        if len(bucket.layers) != 1:
            raise ValueError("a parameter-server worker exchanges one layer per bucket (bucket_bytes=0)")
        units = self.job.units_of[id(bucket.layers[0].module)]
        step = self._exchanges.get(units[0], self._first_step)
        self._last_step = max(self._last_step, step)
        if self.timeline is not None:
            self.timeline.instant(f"grad {self.job.layers[units[0]][0]}", "grad", "backward", time.time(), step)
        if self._local_server_engine is not None and step > self._first_step and not self.staleness:
            # Colocated: this rank's checkpoint of step - 1 (its server's step end) reads this worker's
            # error-feedback state; the step's first compression must not change it before.
            self._local_server_engine.wait_for_step(step - 1)
        self._announce(step)
        for unit in units:
            server = self.job.server_of(unit)
            if server != self.rank:
                for piece in self.job.pull.table[unit]:
                    # The server sends these parameters only after this push: the receive is in place in time.
                    self._recvs.post(server, piece.id, step)
        for unit in units:
            self._current = (unit, step)
            params = self.job.layers[unit][2]
            unit_grad = grad if len(units) == 1 else _rows_of(grad, bucket.params, params)
            decay = [p.detach() for p in params] if self.memory.needs_params else None
            self.start_flat(unit, self.job.shapes(unit), unit_grad, decay)
        return _Pull(self, units, step)

    def _exchange(self, compressor: Compressor, payload: Any, ctx: Any,
                  out: torch.Tensor | None = None) -> None:   # start's _Pull waits
        layer, step = self._current
        width = wire_width(compressor, payload, ctx)
        row = pack_row(payload, width)
        pieces = self.job.push.table[layer]
        capacity = pieces[-1].offset + pieces[-1].numel
        if width > capacity:
            raise RuntimeError(f"layer {self.job.layers[layer][0]}: a push row of {width} bytes exceeds the "
                               f"{capacity} the servers expect")
        server = self.job.server_of(layer)
        if server == self.rank:   # colocated: this rank's own shard, in memory
            self._local_server.deliver(layer, step, row)
        else:
            self._push(server, layer, step, row, width)
        if compressor.keeps_sum:   # while the push is on its way (the row is a copy)
            compressor.keep_sum([self._agree(t) for t in payload[:1]], ctx)
        return None

    def _push(self, server: int, layer: int, step: int, row: torch.Tensor, width: int) -> None:
        channels, pieces = self.job.channels, self.job.push.table[layer]
        transfers = [Transfer(server, channels.group(server, self.rank, self.job.push.channel[piece.id]),
                              channels.id(server, self.rank, self.job.push.channel[piece.id]), piece.id, step,
                              row.narrow(0, piece.offset, size), self.job.order(self.job.push, piece, self.rank, server),
                              self._sent, channels.ack_group(server, self.rank))
                     for piece, size in pieces_within(pieces, width)]
        self._count(sum(t.nbytes for t in transfers), 0)
        try:
            self.scheduler.submit(transfers)
        except TransferError as exc:
            self._waiter.fail("pushing to a parameter server failed", exc)
            self._waiter.raise_if_failed()

    def pulled_locally(self, unit: int, step: int, params: torch.Tensor | None = None) -> None:
        """Colocated: this rank's server updated ``unit`` of ``step`` in place, or (stale) in its own
        storage, whose flat ``params`` are staged here."""
        if params is not None:
            self._version(unit, step + 1).copy_(params)
        with self._waiter.cond:
            self._pull_done(unit, step)

    def _pull_done(self, unit: int, step: int) -> None:
        """``unit``'s update of ``step`` is staged (the caller holds the condition). Under staleness an
        update can complete before an earlier one whose last slices are still on the wire."""
        ahead = self._pulled_ahead[unit]
        ahead.add(step)
        while self._pulled[unit] + 1 in ahead:
            ahead.remove(self._pulled[unit] + 1)
            self._pulled[unit] += 1
        self._waiter.cond.notify_all()

    def _version(self, unit: int, version: int) -> torch.Tensor:
        """The staging slot of ``unit``'s parameters of step ``version`` (its server's update of ``version - 1``)."""
        return self._staging[unit][version % (self.staleness + 1)]

    @contextlib.contextmanager
    def newest_parameters(self) -> Iterator[None]:
        """Within the block, the model holds the parameters of the servers' last update (evaluation, saving);
        afterwards again those the fixed delay gives the next step. Without staleness they are the same.
        Call it after the engine's ``synchronize``."""
        last = self._last_step
        if not self.staleness or last < 0:
            yield
            return
        self._waiter.wait_for(lambda: all(pulled >= last for pulled in self._pulled.values()), self._check_scheduler)
        units = sorted(self._staging)
        kept = {unit: torch.cat([p.detach().reshape(-1) for p in self.job.layers[unit][2]]) for unit in units}
        for unit in units:
            _copy_into(self.job.layers[unit][2], self._version(unit, last + 1))
        try:
            yield
        finally:
            for unit in units:
                _copy_into(self.job.layers[unit][2], kept[unit])

    def _agree(self, tensor: torch.Tensor) -> torch.Tensor:
        return no_agreement(tensor) if self.group is None else super()._agree(tensor)

    def next_done(self, pending: Sequence[PendingSync]) -> int:
        self._waiter.wait_for(lambda: any(p.is_done() for p in pending), self._check_scheduler)
        return next(i for i, p in enumerate(pending) if p.is_done())

    # ------------------------------------------------------------- reports
    def report(self, loss: float, correct: int, samples: int) -> None:
        """Tell server rank 0 this step's loss and hits (it shows the job's progress)."""
        self._settle(self._reports)
        message = torch.tensor([loss, correct, samples], dtype=torch.float64)
        self._reports = [dist.isend(message, 0, group=self.job.channels.group(0, self.rank, 0), tag=REPORT_TAG)]
        self._report_buffer = message   # alive until the send completes

    def close(self) -> None:
        """End every channel's stream and the step announcements, then stop the threads.

        Colocated, this rank's server is closed in between: it ends its streams
        once every other worker ended theirs, and this worker's receivers end at
        the other servers' ends.
        """
        channels = self.job.channels
        self.scheduler.submit(mark for server in self._servers for c in range(channels.count)
                              for mark in stop_marks(server, channels.group(server, self.rank, c),
                                                     channels.id(server, self.rank, c)))
        with self._announce_lock:
            self._send_step(-1)
        try:
            # A shared scheduler also carries this rank's server's replies: its server closes it.
            self.scheduler.close() if self._owns_scheduler else self.scheduler.drain()
        except TransferError as exc:
            self._waiter.fail("pushing to a parameter server failed", exc)
        self._settle(self._reports + self._announcements)
        if self._local_server_engine is not None:
            self._local_server_engine.close()
        for receiver in self._receivers:   # each ends at its server's stop mark
            while receiver.is_alive():
                receiver.join(0.5)
                self._waiter.raise_if_failed()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -------------------------------------------------------- announcements
    def _announce_hook(self, layer: int) -> Callable[..., None]:
        # After a layer's training forward its previous exchange has ended (the
        # engine's wait saw to it), so its exchange count is the step being
        # computed: announce it (once), and the servers post its push receives
        # while the rest of forward and backward run. Called per forward, so a
        # part run on several pieces of a batch (hybrid) still announces once.
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training:
                self._announce(self._exchanges.get(layer, self._first_step))
        return hook

    def _announce(self, step: int) -> None:
        with self._announce_lock:
            if self._announced < step:
                self._announced = step
                self._send_step(step)

    def _send_step(self, step: int) -> None:
        """Tell every server that ``step`` starts (-1: no more), so it posts this step's push receives."""
        self._settle(self._announcements)
        message = torch.tensor([step], dtype=torch.int64)
        self._announcements = [dist.isend(message, server, group=self.job.channels.group(server, self.rank, 0),
                                          tag=STEP_TAG) for server in self._servers]
        self._announcement = message   # alive until the sends complete

    def _settle(self, works: list) -> None:
        """Wait for small sends to the servers; a dead server becomes a PSError naming it."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            self._waiter.fail("a parameter server failed", exc)
        self._waiter.raise_if_failed()

    # ------------------------------------------------------- helper threads
    def _check_scheduler(self) -> None:
        if self.scheduler.error is not None:
            self._waiter.fail("pushing to a parameter server failed", self.scheduler.error)

    def _sent(self, transfer: Transfer, issued: float, done: float) -> None:
        if self.timeline is not None and transfer.payload is not None:
            piece = self.job.push.slice(transfer.slice_id)
            self.timeline.span(f"push {self.job.layers[piece.layer][0]}[{piece.part}]", "push",
                               f"push ch{transfer.channel} -> s{transfer.peer}", issued, done, transfer.step,
                               bytes=transfer.nbytes, priority=list(transfer.priority))

    def _buffer_of(self, slice_id: int, step: int) -> torch.Tensor:
        piece = self.job.pull.slice(slice_id)
        return view(self._version(piece.layer, step + 1), piece)

    def _pull_handler(self, server: int, channel: int) -> Callable[[int, int, float], None]:
        track = f"pull ch{self.job.channels.id(server, self.rank, channel)} <- s{server}"

        def on_slice(slice_id: int, step: int, started: float) -> None:
            piece = self.job.pull.slice(slice_id)
            nbytes = HEADER_BYTES + piece.numel * 4
            self._count(0, nbytes)
            if self.timeline is not None:
                self.timeline.span(f"pull {self.job.layers[piece.layer][0]}[{piece.part}]", "pull", track, started,
                                   time.time(), step + 1, bytes=nbytes)
            key = (piece.layer, step)
            with self._waiter.cond:
                self._arrived[key] = self._arrived.get(key, 0) + 1
                if self._arrived[key] == len(self.job.pull.table[piece.layer]):
                    del self._arrived[key]
                    self._pull_done(piece.layer, step)
        return on_slice

    def _failure(self, message: str) -> Callable[[BaseException], None]:
        return lambda exc: self._waiter.fail(message, exc)

    def explain_failure(self, exc: BaseException) -> BaseException:
        """A lost peer seen anywhere on this rank (a collective of the loop's, a send) is most likely
        the server its receivers are about to report: wait for them a moment and name it."""
        if not peer_lost(exc) or isinstance(exc, PSError):
            return exc
        failure = self._waiter.failure_within(SERVER_FAILURE_GRACE_S)
        if failure is None:
            return exc
        try:   # chained to the collective's error, as a raise would chain it
            raise PSError(failure) from exc
        except PSError as explained:
            return explained


    def _compute_hooks(self, model: nn.Module) -> list[Any]:
        """Forward spans of every layer and the forward's waits for its parameters, for the Chrome trace.

        The pre-hook waits for the layer's pull itself (the engine's own wait,
        which follows, then finds it done), so the trace shows how long the next
        forward waited for the network, apart from the layer's compute.
        """
        started: dict[int, float] = {}
        handles = []
        for module in model.modules():
            layer = self.job.index_of.get(id(module))
            if layer is None:
                continue

            def before(m: nn.Module, args: Any, layer: int = layer) -> None:
                if m.training:
                    self._trace_wait(layer)
                started[layer] = time.time()

            def after(m: nn.Module, args: Any, output: Any, layer: int = layer) -> None:
                if m.training:
                    self.timeline.span(self.job.layers[layer][0], "compute", "forward", started.get(layer, time.time()),
                                       time.time(), self._announced, layer=layer)
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        return handles

    def _trace_wait(self, layer: int) -> None:
        """Wait for the parameters the forward of ``layer`` needs (the previous step's pull), as a span."""
        step = self._exchanges.get(layer, self._first_step)
        units = self.job.units_of[id(self.job.layers[layer][1])]
        start = time.time()
        self._waiter.wait_for(lambda: all(self._pulled.get(u, step) >= step - 1 for u in units), self._check_scheduler)
        end = time.time()
        if end - start > 1e-4:
            self.timeline.span(f"wait {self.job.layers[layer][0]}", "wait", "forward", start, end, step, layer=layer)


def _copy_into(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` (the parameters, concatenated) into ``params``."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _rows_of(grad: torch.Tensor, layer_params: Sequence[torch.Tensor], unit_params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A unit's part of its layer's flat gradient: the unit's rows of every parameter, concatenated."""
    parts, offset = [], 0
    for whole, part in zip(layer_params, unit_params):
        # The unit's parameter views the layer's from row ``start`` on: its byte offset says which.
        start = (part.data_ptr() - whole.data_ptr()) // whole.element_size()
        parts.append(grad.narrow(0, offset + start, part.numel()))
        offset += whole.numel()
    return torch.cat(parts)
