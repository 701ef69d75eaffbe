"""A server's engine: average each slice's W gradients, update it, send it back by priority.

The server holds its layers' parameters as one parameter per slice, each with
its own optimizer instance, so a slice is updated and sent back the moment
its W gradients are in, while the rest of its layer is still arriving (P3's
update granularity). For element-wise optimizers (every built-in one: SGD,
Adam, AdamW, RMSprop, Adagrad) this is exactly the update of the whole tensor.
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
from convoy.ps.scheduler import SliceScheduler, Transfer, stop_marks
from convoy.ps.settings import PSSettings
from convoy.ps.slicing import flatten_params, view
from convoy.ps.timeline import Timeline
from convoy.ps.trace_graph import model_layers
from convoy.ps.wire import HEADER_BYTES, REPORT_TAG, PostedRecvs, Receiver, StepListener


class ParameterServer:
    """Serves this rank's shard of the layers to every worker.

    Args:
        model: the initial model (identical on every rank); only this server's
            layers are copied, as one parameter per slice.
        roles, rank, channels, routing, settings: as for :class:`convoy.ps.worker.PSWorker`.
        optimizer_class, hyper: the optimizer, instantiated once per slice.
        lr_lambda: ``step -> factor`` of the base learning rate, or ``None``.
        timeline: records spans for the Chrome trace, or ``None``.

    Example::

        >>> server = ParameterServer(model, roles, 0, channels, routing, settings, torch.optim.SGD, {"lr": 0.1})
        >>> server.serve_step()   # returns once every slice of step 0 is updated
    """

    def __init__(self, model: nn.Module, roles: PSRoles, rank: int, channels: Channels, routing: Routing,
                 settings: PSSettings, optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any],
                 lr_lambda: Callable[[int], float] | None = None, timeline: Timeline | None = None):
        self.roles, self.rank, self.channels, self.routing = roles, rank, channels, routing
        self.timeline, self._lr_lambda = timeline, lr_lambda
        all_layers = [Layer(i, name, module, params) for i, (name, module, params) in enumerate(model_layers(model))]
        self.layers = [all_layers[i] for i in routing.layers_of(rank)]
        self.buckets = [Bucket(i, [layer]) for i, layer in enumerate(self.layers)]
        self.sync = Traffic(roles.num_workers)
        self.step = 0
        self._progress = Progress()
        self._params: dict[int, nn.Parameter] = {}
        self._optimizers: dict[int, torch.optim.Optimizer] = {}
        self._inbox: dict[tuple[int, int], torch.Tensor] = {}   # (worker, slice id) -> pushed gradient
        for layer in self.layers:
            flat = flatten_params(layer.params)
            for piece in routing.table[layer.index]:
                self._params[piece.id] = nn.Parameter(view(flat, piece).clone())
                self._optimizers[piece.id] = optimizer_class([self._params[piece.id]], **hyper)
                for worker in roles.workers:
                    self._inbox[(worker, piece.id)] = torch.empty(piece.numel)
        self._base_lrs = {sid: [g["lr"] for g in opt.param_groups] for sid, opt in self._optimizers.items()}
        self._arrivals = {sid: 0 for sid in self._params}
        self._updates = {sid: 0 for sid in self._params}
        self._received: dict[int, int] = {}
        self._sent_bytes: dict[int, int] = {}
        self._stats: dict[int, StepStats] = {}
        self._last_step_end = time.perf_counter()
        self.scheduler = SliceScheduler(settings.credit_bytes, fifo=settings.priority == "fifo",
                                        on_sent=self._sent, name=f"convoy-ps-pull{rank}")
        self._recvs = PostedRecvs(lambda worker, sid: channels.group(rank, worker, routing.channel[sid]),
                                  lambda worker, sid: self._inbox[(worker, sid)])
        self._receivers = [
            Receiver(worker, channels.group(rank, worker, c), self._recvs, self._push_handler(worker, c),
                     self._failure(f"worker rank {worker} failed (channel {c})"),
                     name=f"convoy-ps-push{rank}-w{worker}c{c}")
            for worker in roles.workers for c in range(channels.count)]
        self._receivers += [
            StepListener(worker, channels.group(rank, worker, 0), self._post_pushes(worker),
                         self._failure(f"worker rank {worker} failed"), name=f"convoy-ps-steps{rank}-w{worker}")
            for worker in roles.workers]
        for receiver in self._receivers:
            receiver.start()

    # ------------------------------------------------------------ main thread
    def serve_step(self) -> tuple[float, int]:
        """Wait until every slice of this step is updated; server 0 also collects the workers' losses.

        Returns the mean loss and the mean number of correct predictions per worker.
        """
        step = self.step
        waited = self._progress.wait_for(lambda: self._done(step + 1), self._check_scheduler)
        loss, correct = 0.0, 0
        if self.rank == 0:
            loss, correct = self._collect_reports()
        now = time.perf_counter()
        self._stats[step] = StepStats(step, wall_s=now - self._last_step_end, wait_s=waited)
        self._last_step_end = now
        self.step += 1
        return loss, correct

    def _collect_reports(self) -> tuple[float, int]:
        total = torch.zeros(3, dtype=torch.float64)
        message = torch.empty(3, dtype=torch.float64)
        for worker in self.roles.workers:
            dist.recv(message, worker, group=self.channels.group(0, worker, 0), tag=REPORT_TAG)
            total += message
        workers = self.roles.num_workers
        return total[0].item() / workers, round(total[1].item() / workers)

    def synchronize(self) -> None:
        self._progress.wait_for(lambda: self._done(self.step), self._check_scheduler)

    def stats(self, step: int) -> StepStats:
        self._progress.wait_for(lambda: self._done(step + 1), self._check_scheduler)
        with self._progress.cond:
            stats = self._stats.pop(step)
            stats.bytes_received = self._received.pop(step, 0)
            stats.bytes_sent = self._sent_bytes.pop(step, 0)
        return stats

    def optimizer_state(self) -> list[dict]:
        """Each slice optimizer's ``state_dict``, in slice order."""
        return [self._optimizers[sid].state_dict() for sid in sorted(self._optimizers)]

    def close(self) -> None:
        """Wait for every worker to end its streams, then end this server's streams."""
        for receiver in self._receivers:
            while receiver.is_alive():
                receiver.join(0.5)
                self._progress.raise_if_failed()
        self.scheduler.submit(mark for worker in self.roles.workers for c in range(self.channels.count)
                              for mark in stop_marks(worker, self.channels.group(self.rank, worker, c),
                                                     self.channels.id(self.rank, worker, c)))
        self.scheduler.close()

    def _done(self, steps: int) -> bool:
        return all(count >= steps for count in self._updates.values())

    def _check_scheduler(self) -> None:
        if self.scheduler.error is not None:
            self._progress.fail("sending parameters failed", self.scheduler.error)

    # ------------------------------------------------------- helper threads
    def _post_pushes(self, worker: int) -> Callable[[int], None]:
        def on_step(step: int) -> None:
            # Posted before the worker's backward: its pushes never wait for a receive.
            for slice_id in self._params:
                self._recvs.post(worker, slice_id, step)
        return on_step

    def _push_handler(self, worker: int, channel: int) -> Callable[[int, int, float], None]:
        track = f"push ch{self.channels.id(self.rank, worker, channel)} <- w{worker}"

        def on_slice(slice_id: int, step: int, started: float) -> None:
            nbytes = HEADER_BYTES + self._inbox[(worker, slice_id)].numel() * 4
            self.sync.count(received=nbytes)
            if self.timeline is not None:
                piece = self.routing.slice(slice_id)
                self.timeline.span(f"push {self._name(piece.layer)}[{piece.part}]", "push", track, started,
                                   time.time(), step, bytes=nbytes)
            with self._progress.cond:
                self._received[step] = self._received.get(step, 0) + nbytes
                self._arrivals[slice_id] += 1
                complete = self._arrivals[slice_id] == self.roles.num_workers
                if complete:
                    self._arrivals[slice_id] = 0
            if complete:  # the last worker's thread applies the update
                self._update(slice_id, step)
        return on_slice

    def _update(self, slice_id: int, step: int) -> None:
        start = time.time()
        param, optimizer = self._params[slice_id], self._optimizers[slice_id]
        grad = torch.zeros_like(param)
        for worker in self.roles.workers:   # a fixed order: every run sums identically
            grad.add_(self._inbox[(worker, slice_id)])
        param.grad = grad.div_(self.roles.num_workers)
        if self._lr_lambda is not None:
            factor = self._lr_lambda(step)
            for group, lr in zip(optimizer.param_groups, self._base_lrs[slice_id]):
                group["lr"] = lr * factor
        optimizer.step()
        param.grad = None
        piece = self.routing.slice(slice_id)
        if self.timeline is not None:
            self.timeline.span(f"update {self._name(piece.layer)}[{piece.part}]", "update", "update", start,
                               time.time(), step)
        c = self.routing.channel[slice_id]
        self.scheduler.submit(
            Transfer(worker, self.channels.group(self.rank, worker, c), self.channels.id(self.rank, worker, c),
                     slice_id, step, param.data, self.routing.priority[slice_id])
            for worker in self.roles.workers)
        with self._progress.cond:
            self._sent_bytes[step] = self._sent_bytes.get(step, 0) + self.roles.num_workers * (
                HEADER_BYTES + piece.numel * 4)
            self._updates[slice_id] += 1
            self._progress.cond.notify_all()

    def _sent(self, transfer: Transfer, issued: float, done: float) -> None:
        self.sync.count(sent=transfer.nbytes)
        if self.timeline is not None and transfer.payload is not None:
            piece = self.routing.slice(transfer.slice_id)
            self.timeline.span(f"pull {self._name(piece.layer)}[{piece.part}]", "pull",
                               f"pull ch{transfer.channel} -> w{transfer.peer}", issued, done, transfer.step + 1,
                               bytes=transfer.nbytes, priority=list(transfer.priority))

    def _name(self, layer: int) -> str:
        return next(l.name for l in self.layers if l.index == layer)

    def _failure(self, message: str) -> Callable[[BaseException], None]:
        return lambda exc: self._progress.fail(message, exc)
