"""The layer-wise pipelined engine: one step as a pipeline of per-bucket stages.

The main thread runs forward and backward. A post-accumulate-grad hook on each
parameter raises its layer's flag once the whole layer's gradient is there. An
auxiliary thread takes buckets of layers in one fixed order, the same on every
rank (reverse forward order), and runs each through the stages::

    1. gradient ready   the bucket's flags are up (or, on a parameter server,
                        the step was started with ``run_step``: the gradients
                        come from the workers)
    2. exchange         ``sync.start``: the strategy compresses (with error
                        feedback), exchanges and decompresses
    3. update           a local strategy yields the averaged gradient and the
                        bucket's optimizer applies it here; a strategy that
                        ``returns_parameters`` (a parameter-server worker)
                        yields the parameters its server updated, copied in
    4. snapshot         listeners see each layer final (checkpoints, the
                        parameter server's reply to its workers)
    5. per-layer wait   the next forward's pre-hook on a layer waits only for
                        that layer's update

There is no barrier at the end of backward, so early layers compute while late
layers are still on the wire.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from convoy.core import Listener, PendingSync, StepStats, SyncStrategy, Waiter
from convoy.engine.gradients import GradientGate, check_finite
from convoy.engine.layers import Bucket, ForwardOrderRecorder, Layer, make_buckets
from convoy.engine.optim import LayerOptimizer, bucket_optimizer
from convoy.errors import TrainingDiverged

# Default bucket size: small layers travel and update together (one collective and
# one fused optimizer call), while the large ones still go on their own, so the
# exchange keeps overlapping backward and the next forward.
DEFAULT_BUCKET_BYTES = 1 << 20


class EngineError(RuntimeError):
    """The auxiliary thread failed; the message carries its error."""


class Engine:
    """Data-parallel training with per-layer, pipelined synchronisation and updates.

    Args:
        model: the module to train. Every rank must build it identically.
        optimizer_class: any ``torch.optim.Optimizer`` subclass whose update is
            element-wise per tensor (every built-in one); one instance per bucket
            is created with ``optimizer_kwargs`` (``foreach=True`` where the class
            takes it, so a bucket updates in one multi-tensor kernel).
        sync: how gradients are exchanged; see :mod:`convoy.sync`.
        listeners: told when each layer's update and each step is final.
        lr_lambda: ``step -> factor``; each step's learning rate is the base ``lr``
            times this factor (the rule of ``torch.optim.lr_scheduler.LambdaLR``).
        bucket_bytes: exchange and update consecutive layers together until a
            payload holds at least this many bytes; 0 exchanges and updates every
            layer on its own. Either way the next forward waits per layer.
        gate: whole-step gradient processing (global-norm clipping, fp16
            unscaling). With one, a step's updates wait until every exchange of
            the step ended (the global norm needs every layer), so layers no
            longer update while later ones are still on the wire. Without one,
            each bucket's averaged gradient is only checked to be finite. With a
            strategy that ``returns_parameters`` the update runs elsewhere: the
            gate only follows the updating ranks' decision, once the step's
            exchanges are out (its loss scale stays theirs).
        **optimizer_kwargs: hyper-parameters for ``optimizer_class``.

    Call ``backward(loss)`` instead of ``loss.backward(); optimizer.step()``;
    call ``synchronize()`` before reading parameters (evaluation, saving).

    Example::

        >>> engine = Engine(model, torch.optim.SGD, sync=AllReduce(group), lr=0.05)
        >>> for x, y in batches:
        ...     engine.backward(F.cross_entropy(model(x), y))
        >>> engine.synchronize()
    """

    def __init__(self, model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 sync: SyncStrategy, listeners: Sequence[Listener] = (),
                 lr_lambda: Callable[[int], float] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 gate: GradientGate | None = None, **optimizer_kwargs: Any):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        self._bucket_bytes = bucket_bytes
        self.model = model
        self.sync = sync
        self.listeners = list(listeners)
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = optimizer_kwargs
        self._lr_lambda = lr_lambda
        self.gate = gate if gate is not None and gate.needs_whole_step else None
        self._accumulating = False            # backward of a micro-batch: gradients stay local
        self.layers: list[Layer] = []
        self.buckets: list[Bucket] = []
        self.optimizers: list[LayerOptimizer] = []             # per layer, in forward order
        self._bucket_optimizers: list[torch.optim.Optimizer] = []
        self._recorder: ForwardOrderRecorder | None = ForwardOrderRecorder(model)
        self._pending_state: dict[str, dict] | None = None   # optimizer state to load once layers exist

        self._waiter = Waiter(self._raise_failure)
        self._cond = self._waiter.cond
        self._ready_count: list[int] = []     # params of each bucket whose grad arrived this step
        self._bucket_of: list[Bucket] = []    # each layer's bucket, by layer index
        self._updates_done: list[int] = []    # steps applied to each layer so far
        self._backward_done = -1              # last step whose backward returned
        self._steps_done = -1                 # last step the aux thread finished
        self._stats: dict[int, StepStats] = {}
        self.step = 0                         # the step the next backward belongs to

        self._last_backward_end = time.perf_counter()
        self._wait_s = 0.0
        self._steps: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._hook_handles: list[Any] = []

    # ----------------------------------------------------------------- set-up
    def _build_layers(self) -> None:
        """Freeze the forward order seen in the first forward and attach the hooks."""
        assert self._recorder is not None
        self.layers = self._recorder.finish()
        self._recorder = None
        if not self.layers:
            raise ValueError("the model has no trainable parameters")
        self.buckets = make_buckets(self.layers, self._bucket_bytes)
        for bucket in self.buckets:
            bucket.attach_grads()
        self._bucket_optimizers = [bucket_optimizer(self._optimizer_class, bucket.params, self._optimizer_kwargs)
                                   for bucket in self.buckets]
        by_layer = {layer.index: LayerOptimizer(opt, layer.params)
                    for bucket, opt in zip(self.buckets, self._bucket_optimizers) for layer in bucket.layers}
        self.optimizers = [by_layer[layer.index] for layer in self.layers]
        self._base_lrs = [[g["lr"] for g in opt.param_groups] for opt in self._bucket_optimizers]
        if self._pending_state is not None:
            self.load_optimizer_state(self._pending_state)
        self._ready_count = [0] * len(self.buckets)
        self._bucket_of = [None] * len(self.layers)
        for bucket in self.buckets:
            for layer in bucket.layers:
                self._bucket_of[layer.index] = bucket
        self._updates_done = [self.step] * len(self.layers)
        self._backward_done = self._steps_done = self.step - 1
        for layer in self.layers:
            for p in layer.params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._flag_hook(layer)))
            self._hook_handles.append(layer.module.register_forward_pre_hook(self._wait_hook(layer)))
        self._thread = threading.Thread(target=self._aux_main, name="convoy-aux", daemon=True)
        self._thread.start()

    def _flag_hook(self, layer: Layer) -> Callable[[torch.Tensor], None]:
        bucket = self._bucket_of[layer.index]
        expected = len(bucket.params)

        def hook(param: torch.Tensor) -> None:
            if self._accumulating:   # not the step's last micro-batch: nothing to exchange yet
                return
            with self._cond:
                self._ready_count[bucket.index] += 1
                # Only a whole bucket wakes the auxiliary thread: one wake-up per
                # exchange, not one per parameter (context switches cost CPU).
                if self._ready_count[bucket.index] == expected:
                    self._cond.notify_all()
        return hook

    def _wait_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._updates_done[layer.index] < self.step:
                self._wait_for(lambda: self._updates_done[layer.index] >= self.step)
        return hook

    # ------------------------------------------------------------ main thread
    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Back-propagate ``loss`` and hand this step's layers to the auxiliary thread.

        Returns as soon as backward ends; synchronisation and updates go on in
        the background. ``grad`` is passed to ``torch.autograd.backward`` for a
        non-scalar ``loss`` (e.g. activations whose gradient came from a peer).
        """
        if self._recorder is not None:
            self._build_layers()
        self._raise_if_failed()
        step = self.step
        self._steps.put(step)
        torch.autograd.backward(loss, grad)
        self._handed_over(step)

    def run_step(self) -> None:
        """Start a step whose gradients come from the sync strategy, not from a local backward.

        A parameter server's engine has no forward or backward: its strategy's
        exchange collects the workers' pushes, and the update stage runs here,
        on the shard this rank owns. Returns at once, like ``backward``.
        """
        if self._recorder is not None:
            self._build_layers()
        self._raise_if_failed()
        self._steps.put(self.step)
        self._handed_over(self.step)

    def _handed_over(self, step: int) -> None:
        """``step``'s gradients are all there (backward returned): stage 1 is over for every layer."""
        now = time.perf_counter()
        with self._cond:
            self._backward_done = step
            stats = self._stats.setdefault(step, StepStats(step))
            stats.record_times(now - self._last_backward_end, self._wait_s)
            self._cond.notify_all()
        self._last_backward_end = now
        self._wait_s = 0.0
        self.step += 1

    def accumulate(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Back-propagate ``loss`` of a micro-batch without exchanging or updating.

        Gradients add up in the layers' buffers; the next :meth:`backward` (the
        step's last micro-batch) hands the sum to the exchange, so N micro-batches
        of a step equal one N-times larger batch when each loss is divided by N.
        ``self.step`` does not advance, so the next forward waits for nothing.
        ``grad`` is as for :meth:`backward`.

        Example::

            >>> for x, y in micro_batches[:-1]:
            ...     engine.accumulate(F.cross_entropy(model(x), y) / len(micro_batches))
            >>> engine.backward(F.cross_entropy(model(x_last), y_last) / len(micro_batches))
        """
        if self._recorder is not None:
            self._build_layers()
        self._raise_if_failed()
        self._accumulating = True
        try:
            torch.autograd.backward(loss, grad)
        finally:
            self._accumulating = False

    def synchronize(self) -> None:
        """Block until every step handed to ``backward`` is applied on every layer."""
        if self.layers:
            self._wait_for(lambda: self._steps_done >= self.step - 1)

    def wait_for_step(self, step: int) -> None:
        """Block until the auxiliary thread has finished ``step`` (its updates and every listener's step end);
        before the first step has started there is nothing to wait for."""
        if self.layers:
            self._wait_for(lambda: self._steps_done >= step)

    def stats(self, step: int) -> StepStats:
        """Accounting of ``step`` (blocks until the auxiliary thread has finished it)."""
        self._wait_for(lambda: self._steps_done >= step)
        with self._cond:
            return self._stats.pop(step)

    def close(self) -> None:
        """Finish outstanding steps and stop the auxiliary thread."""
        if self._thread is not None and self._thread.is_alive():
            self.synchronize()
            self._steps.put(None)
            self._thread.join()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self.sync.close()

    def explain_failure(self, exc: BaseException) -> BaseException:
        """The error to report for ``exc``, which ended training: its sync strategy's word on it."""
        return self.sync.explain_failure(exc)

    def set_step(self, step: int) -> None:
        """Start counting at ``step`` (used when resuming from a checkpoint)."""
        if self._thread is not None:
            raise RuntimeError("set_step must be called before the first backward")
        self.step = step
        self.sync.set_step(step)  # warm-up and shared random draws continue where they stopped

    def load_optimizer_state(self, states: dict[str, dict]) -> None:
        """Load saved per-layer optimizer ``state`` (``state_dict()["state"]``), keyed by layer name.

        Before the first backward the layers do not exist yet; the states are
        kept and loaded when they are built. Hyper-parameters stay as configured.
        """
        if not self.layers:
            self._pending_state = states
            return
        self._pending_state = None
        for layer, opt in zip(self.layers, self.optimizers):
            if layer.name in states:
                opt.load_state_dict({"state": states[layer.name]})

    def _wait_for(self, predicate: Callable[[], bool]) -> None:
        waited = self._waiter.wait_for(predicate)
        if threading.current_thread() is not self._thread:
            self._wait_s += waited

    def _raise_if_failed(self) -> None:
        self._waiter.raise_if_failed()

    @staticmethod
    def _raise_failure(message: str, error: BaseException) -> None:
        if isinstance(error, TrainingDiverged):   # the run's numbers, not a failed exchange
            raise TrainingDiverged(error.step, error.what)
        raise EngineError(f"gradient synchronisation failed: {message}") from error

    # ------------------------------------------------------- auxiliary thread
    def _aux_main(self) -> None:
        try:
            while (step := self._steps.get()) is not None:
                self._run_step(step)
        except BaseException as exc:  # the main thread re-raises it
            self._waiter.fail("", exc)

    def _run_step(self, step: int) -> None:
        self._apply_lr(step)
        sent0, received0 = self.sync.traffic()
        in_flight: list[tuple[Bucket, PendingSync]] = []
        exchanged: list[Bucket] = []   # with a gate: buckets whose update waits for the whole step
        previous: PendingSync | None = None
        for bucket in self.buckets:
            self._wait_ready(bucket, step)                                         # 1. gradient ready
            pending = self.sync.start(bucket, bucket.flat_grad())                  # 2. exchange
            if previous is not None:
                # The previous bucket's second round (PowerSGD's Q) goes out once this one's first
                # is out: its first round's sum had this bucket's wait and compression to arrive,
                # instead of stalling this thread. The same order on every rank: P0 P1 Q0 P2 Q1 ...
                previous.advance()
            in_flight.append((bucket, pending))
            previous = pending
            self._finish_done(in_flight, step, exchanged)
        if previous is not None:
            previous.advance()
        if self.gate is not None and self.sync.returns_parameters:
            # Every push is out; the updating ranks (servers) decide the step with this rank in the gate's group.
            self.gate.follow(step)
        while in_flight:
            self._finish_exchange(*in_flight.pop(self.sync.next_done([p for _, p in in_flight])), step, exchanged)
        if self.gate is not None and not self.sync.returns_parameters:
            apply = self.gate.process([bucket.flat_grad() for bucket in exchanged], step)
            for bucket in exchanged:
                self._update_bucket(bucket, step, apply)
        sent1, received1 = self.sync.traffic()
        with self._cond:
            stats = self._stats.setdefault(step, StepStats(step))
            stats.record_bytes(sent1 - sent0, received1 - received0)
        for listener in self.listeners:
            listener.on_step_end(step, stats)
        with self._cond:
            self._steps_done = step
            self._cond.notify_all()

    def _wait_ready(self, bucket: Bucket, step: int) -> None:
        # A layer whose parameters backward never reached (unused this step)
        # counts as ready once backward returns: its gradient is zero.
        expected = len(bucket.params)
        self._waiter.wait_for(lambda: (self._ready_count[bucket.index] >= expected
                                       or self._backward_done >= step))
        with self._cond:
            self._ready_count[bucket.index] = 0

    def _finish_done(self, in_flight: list[tuple[Bucket, PendingSync]], step: int,
                     exchanged: list[Bucket]) -> None:
        """Finish the exchanges that already ended (only from the front for in-order strategies)."""
        i = 0
        while i < len(in_flight):
            if in_flight[i][1].is_done():
                self._finish_exchange(*in_flight.pop(i), step, exchanged)
            elif self.sync.completes_in_order:
                return
            else:
                i += 1

    def _finish_exchange(self, bucket: Bucket, pending: PendingSync, step: int, exchanged: list[Bucket]) -> None:
        result = pending.wait()
        if self.sync.returns_parameters:   # 3. the update ran on a server: take its parameters
            if result is not None:   # None: the strategy put them in place (a colocated server's own shard)
                bucket.set_params(result)
            self._update_bucket(bucket, step, apply=False)
            return
        bucket.set_grads(result, pending.support)
        if self.gate is not None:
            exchanged.append(bucket)
            return
        if not pending.finite:   # before a NaN reaches the parameters
            check_finite(bucket.flat_grad(), step, f"layer {bucket.name}")
        self._update_bucket(bucket, step, apply=True)

    def _update_bucket(self, bucket: Bucket, step: int, apply: bool) -> None:
        if apply:                                                                  # 3. update
            next(opt for b, opt in zip(self.buckets, self._bucket_optimizers) if b is bucket).step()
        bucket.reset_grads()
        for layer in bucket.layers:                                                # 4. snapshot
            # Listeners run before the next forward may use the layer, so a
            # checkpoint's snapshot sees exactly this step's parameters and buffers.
            for listener in self.listeners:
                listener.on_layer_updated(layer, step)
            with self._cond:
                self._updates_done[layer.index] += 1
        with self._cond:   # one wake-up of the next forward per bucket
            self._cond.notify_all()

    def _apply_lr(self, step: int) -> None:
        if self._lr_lambda is None:
            return
        factor = self._lr_lambda(step)
        for opt, base in zip(self._bucket_optimizers, self._base_lrs):
            for group, lr in zip(opt.param_groups, base):
                group["lr"] = lr * factor

    # ------------------------------------------------------------ inspection
    @property
    def loss_scaler(self) -> Any:
        """The fp16 loss scaler the gate unscales with, if any (checkpoints keep its scale)."""
        return self.gate.scaler if self.gate is not None else None

    def parameters(self) -> Iterable[nn.Parameter]:
        return (p for layer in self.layers for p in layer.params)

    def optimizer_state(self) -> list[dict]:
        """Each layer's optimizer ``state_dict`` (indices local to the layer), in forward order."""
        return [opt.state_dict() for opt in self.optimizers]
