"""A worker's engine: push each layer's gradient when ready, wait per layer for its parameters.

Backward's post-accumulate-grad hooks hand a layer's flat gradient, cut into
slices, to the push scheduler the moment the layer's last gradient lands.
Receiver threads, one per (server, channel), put pulled slices into a staging
vector per layer and copy a layer into the model once all its slices are in.
The next forward's pre-hook on a layer waits only for that layer.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.engine.layers import Bucket, Layer
from convoy.engine.stats import StepStats
from convoy.ps.channels import Channels
from convoy.ps.progress import Progress, Traffic
from convoy.ps.roles import PSRoles
from convoy.ps.routing import Routing
from convoy.ps.scheduler import SliceScheduler, Transfer, TransferError, stop_marks
from convoy.ps.settings import PSSettings
from convoy.ps.slicing import unflatten_into, view
from convoy.ps.timeline import Timeline
from convoy.ps.trace_graph import model_layers
from convoy.ps.wire import HEADER_BYTES, REPORT_TAG, STEP_TAG, PostedRecvs, Receiver


class PSWorker:
    """Trains ``model`` on this worker's batches; the servers own the update.

    Args:
        model: this worker's replica, identical on every rank at the start.
        roles: who serves and who trains.
        rank: this process's global rank (a worker).
        channels: the process groups to every server.
        routing: slices, owners, priorities and channels (identical on every rank).
        settings: priority mode, credit window.
        timeline: records spans for the Chrome trace, or ``None``.

    Use like :class:`convoy.Engine`: ``backward(loss)`` after each forward,
    ``synchronize()`` before reading parameters, ``close()`` at the end.

    Example::

        >>> worker = PSWorker(model, roles, rank, channels, routing, settings)
        >>> for x, y in batches:
        ...     worker.backward(F.cross_entropy(model(x), y))   # forward waits per layer
        >>> worker.synchronize(); worker.close()
    """

    def __init__(self, model: nn.Module, roles: PSRoles, rank: int, channels: Channels, routing: Routing,
                 settings: PSSettings, timeline: Timeline | None = None, unseen: tuple[int, ...] = ()):
        self.model, self.roles, self.rank = model, roles, rank
        self.channels, self.routing, self.timeline = channels, routing, timeline
        self.layers = [Layer(i, name, module, params) for i, (name, module, params) in enumerate(model_layers(model))]
        self.buckets = [Bucket(i, [layer]) for i, layer in enumerate(self.layers)]
        for bucket in self.buckets:
            bucket.attach_grads()
        self.sync = Traffic(roles.num_workers)
        self.step = 0
        self._progress = Progress()
        self._staging = [torch.empty(sum(p.numel() for p in layer.params)) for layer in self.layers]
        self._arrived = [0] * len(self.layers)     # slices of the pending pull that are in
        self._updates = [0] * len(self.layers)     # pulls applied to each layer
        self._ready = [0] * len(self.layers)       # parameters whose gradient landed this step
        self._pushed = [False] * len(self.layers)
        self._received: dict[int, int] = {}         # step -> pulled bytes
        self._pushed_bytes: dict[int, int] = {}     # step -> pushed bytes
        self._stats: dict[int, StepStats] = {}
        self._wait_s = 0.0
        self._last_backward_end = time.perf_counter()
        self._reports: list[Any] = []
        self._announced = -1                        # last step announced to the servers
        self._announcements: list[Any] = []
        self._forward_start: dict[int, float] = {}
        self.scheduler = SliceScheduler(settings.credit_bytes, fifo=settings.priority == "fifo",
                                        on_sent=self._sent, name=f"convoy-ps-push{rank}")
        self._recvs = PostedRecvs(lambda server, sid: channels.group(server, rank, routing.channel[sid]),
                                  lambda server, sid: self._buffer_of(sid))
        self._receivers = [
            Receiver(server, channels.group(server, rank, c), self._recvs, self._pull_handler(server, c),
                     self._failure(f"parameter server rank {server} failed (channel {c})"),
                     name=f"convoy-ps-pull{rank}-s{server}c{c}")
            for server in roles.server_ranks for c in range(channels.count)]
        for receiver in self._receivers:
            receiver.start()
        self._handles: list[Any] = []
        for layer in self.layers:
            for p in layer.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(layer)))
            self._handles.append(layer.module.register_forward_pre_hook(self._wait_hook([layer.index])))
            if timeline is not None:
                self._handles.append(layer.module.register_forward_hook(self._compute_hook(layer)))
        if unseen:  # parameters a parent module uses itself: needed before the forward starts
            self._handles.append(model.register_forward_pre_hook(self._wait_hook(list(unseen))))
        self._handles.append(model.register_forward_pre_hook(self._announce_hook, prepend=True))

    # ------------------------------------------------------------ main thread
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``; every layer's gradient is pushed as soon as it is complete."""
        self._progress.raise_if_failed()
        step = self.step
        self._announce(step)
        for layer, server in enumerate(self.routing.owner):
            # The servers send this step's parameters only after this step's
            # pushes, so receives posted now are always in place in time.
            for piece in self.routing.table[layer]:
                self._recvs.post(server, piece.id, step)
        self._pushed = [False] * len(self.layers)
        torch.autograd.backward(loss)
        for layer in self.layers:  # layers backward did not reach push a zero gradient
            if not self._pushed[layer.index]:
                self._push(layer, step)
        now = time.perf_counter()
        self._stats[step] = StepStats(step, wall_s=now - self._last_backward_end, wait_s=self._wait_s)
        self._last_backward_end, self._wait_s = now, 0.0
        self.step += 1

    def report(self, loss: float, correct: int, samples: int) -> None:
        """Tell server 0 this step's loss and hits (it shows the job's progress)."""
        self._settle(self._reports)
        message = torch.tensor([loss, correct, samples], dtype=torch.float64)
        group = self.channels.group(0, self.rank, 0)
        self._reports = [dist.isend(message, 0, group=group, tag=REPORT_TAG)]
        self._report_buffer = message   # alive until the send completes

    def synchronize(self) -> None:
        """Block until every layer holds the parameters after the last step's update."""
        self._wait(lambda: min(self._updates) >= self.step)

    def stats(self, step: int) -> StepStats:
        """Time and bytes of ``step`` (blocks until its parameters are all back)."""
        self._wait(lambda: min(self._updates) >= step + 1)
        with self._progress.cond:
            stats = self._stats.pop(step)
            stats.bytes_received = self._received.pop(step, 0)
            stats.bytes_sent = self._pushed_bytes.pop(step, 0)
        return stats

    def optimizer_state(self) -> list[dict]:
        return []   # the optimizer state lives on the servers

    def close(self) -> None:
        """Finish, end every channel's stream, and stop the threads."""
        self.synchronize()
        self.scheduler.submit(mark for server in self.roles.server_ranks for c in range(self.channels.count)
                              for mark in stop_marks(server, self.channels.group(server, self.rank, c),
                                                     self.channels.id(server, self.rank, c)))
        self._send_step(-1)
        try:
            self.scheduler.close()
        except TransferError as exc:
            self._progress.fail("pushing to a parameter server failed", exc)
        self._settle(self._reports + self._announcements)
        for receiver in self._receivers:   # each ends at its server's stop mark
            while receiver.is_alive():
                receiver.join(0.5)
                self._progress.raise_if_failed()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _wait(self, predicate: Callable[[], bool]) -> float:
        return self._progress.wait_for(predicate, self._check_scheduler)

    def _check_scheduler(self) -> None:
        if self.scheduler.error is not None:
            self._progress.fail("pushing to a parameter server failed", self.scheduler.error)

    def _settle(self, works: list) -> None:
        """Wait for small sends to the servers; a dead server becomes a PSError naming it."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            self._progress.fail("a parameter server failed", exc)
        self._progress.raise_if_failed()

    def _announce(self, step: int) -> None:
        if self._announced < step:
            self._announced = step
            self._send_step(step)

    def _send_step(self, step: int) -> None:
        """Tell every server that ``step`` starts (-1: no more), so it posts this step's push receives."""
        self._settle(self._announcements)
        message = torch.tensor([step], dtype=torch.int64)
        self._announcements = [dist.isend(message, server, group=self.channels.group(server, self.rank, 0),
                                          tag=STEP_TAG) for server in self.roles.server_ranks]
        self._announcement = message   # alive until the sends complete

    # ------------------------------------------------------------------ hooks
    def _announce_hook(self, module: nn.Module, args: Any) -> None:
        if module.training:   # the first training forward of a step: pushes will follow
            self._announce(self.step)

    def _wait_hook(self, layers: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            step = self.step
            if any(self._updates[i] < step for i in layers):
                start = time.time()
                self._wait_s += self._wait(lambda: all(self._updates[i] >= step for i in layers))
                if self.timeline is not None:
                    names = "+".join(self.layers[i].name for i in layers)
                    self.timeline.span(f"wait {names}", "wait", "forward", start, time.time(), step)
            for i in layers:
                # The previous push of this layer is complete (its parameters came
                # back), so its gradient buffer can take this step's gradient.
                self.buckets[i].reset_grads()
            self._forward_start[layers[0]] = time.time()
        return hook

    def _compute_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training:
                self.timeline.span(layer.name, "compute", "forward", self._forward_start.get(layer.index, time.time()),
                                   time.time(), self.step, layer=layer.index)
        return hook

    def _grad_hook(self, layer: Layer) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._ready[layer.index] += 1
            if self._ready[layer.index] == len(layer.params):
                if self.timeline is not None:
                    self.timeline.instant(f"grad {layer.name}", "compute", "backward", time.time(), self.step)
                self._push(layer, self.step)
        return hook

    def _push(self, layer: Layer, step: int) -> None:
        self._ready[layer.index] = 0
        self._pushed[layer.index] = True
        flat = self.buckets[layer.index].flat_grad()
        server = self.routing.owner[layer.index]
        transfers = []
        for piece in self.routing.table[layer.index]:
            c = self.routing.channel[piece.id]
            transfers.append(Transfer(server, self.channels.group(server, self.rank, c),
                                      self.channels.id(server, self.rank, c), piece.id, step, view(flat, piece),
                                      self.routing.priority[piece.id]))
        with self._progress.cond:
            self._pushed_bytes[step] = self._pushed_bytes.get(step, 0) + sum(t.nbytes for t in transfers)
        try:
            self.scheduler.submit(transfers)
        except TransferError as exc:
            self._progress.fail("pushing to a parameter server failed", exc)
            self._progress.raise_if_failed()

    # ------------------------------------------------------- helper threads
    def _sent(self, transfer: Transfer, issued: float, done: float) -> None:
        self.sync.count(sent=transfer.nbytes)
        if self.timeline is not None and transfer.payload is not None:
            piece = self.routing.slice(transfer.slice_id)
            self.timeline.span(f"push {self.layers[piece.layer].name}[{piece.part}]", "push",
                               f"push ch{transfer.channel} -> s{transfer.peer}", issued, done, transfer.step,
                               bytes=transfer.nbytes, priority=list(transfer.priority))

    def _buffer_of(self, slice_id: int) -> torch.Tensor:
        piece = self.routing.slice(slice_id)
        return view(self._staging[piece.layer], piece)

    def _pull_handler(self, server: int, channel: int) -> Callable[[int, int, float], None]:
        track = f"pull ch{self.channels.id(server, self.rank, channel)} <- s{server}"

        def on_slice(slice_id: int, step: int, started: float) -> None:
            piece = self.routing.slice(slice_id)
            nbytes = HEADER_BYTES + piece.numel * 4
            self.sync.count(received=nbytes)
            if self.timeline is not None:
                self.timeline.span(f"pull {self.layers[piece.layer].name}[{piece.part}]", "pull", track, started,
                                   time.time(), step + 1, bytes=nbytes)
            with self._progress.cond:
                self._received[step] = self._received.get(step, 0) + nbytes
                self._arrived[piece.layer] += 1
                complete = self._arrived[piece.layer] == len(self.routing.table[piece.layer])
                if complete:
                    self._arrived[piece.layer] = 0
            if complete:
                layer = self.layers[piece.layer]
                unflatten_into(self._staging[layer.index], layer.params)
                with self._progress.cond:
                    self._updates[layer.index] += 1
                    self._progress.cond.notify_all()
        return on_slice

    def _failure(self, message: str) -> Callable[[BaseException], None]:
        return lambda exc: self._progress.fail(message, exc)
