"""convoy's gradient compressors as DDP communication hooks.

``comm_hook(name, **options)`` returns the ``(state, hook)`` pair that torch's
``DistributedDataParallel.register_comm_hook(state, hook)`` takes, and that
Lightning takes as ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)``::

    model = DistributedDataParallel(net)
    model.register_comm_hook(*convoy.ddp.comm_hook("blocktopk", block_fraction=0.01))

The hook runs convoy's own exchange (:class:`convoy.sync.AllReduce`) on each
DDP bucket: error feedback is kept per bucket index, summable payloads are
all-reduced and the others all-gathered, and the future DDP waits on holds the
averaged flat gradient.

Safe under gloo with any number of buckets, because every rank does the same
things on one thread:

- a bucket's collectives are issued from the thread that runs the backward pass
  (DDP's), in bucket-index order on every rank, whatever order DDP hands the
  buckets over in: a bucket that arrives early waits until those before it are
  started (torch's own PowerSGD hook issues its second all-reduce from a
  callback on gloo's thread instead, so ranks can issue them in different orders
  and hang);
- no Python runs on gloo's threads: the futures are plain ones, completed by the
  hook call of the step's last bucket, which waits for every collective of the
  step. A Python callback chained on a gloo future (``Future.then``) runs, and is
  destroyed, on gloo's thread, which then needs the interpreter: if that thread
  loses the race with the interpreter's exit, it is ended inside C++ and the
  process aborts ("terminate called without an active exception");
- no tensor of a collective is let go before gloo has let go of it
  (:class:`convoy.utils.collective.AsyncCollective`), so gloo never frees a
  Python object on its thread either, which aborts the same way at exit.
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations
# against the real dist.GradBucket and Future[Tensor] objects, not strings.
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from convoy.compress import Compressor, Memory, build_compressor, compressor_names, compressor_spec
from convoy.core.sync import PendingSync
from convoy.errors import UsageError
from convoy.sync import AllReduce
from convoy.sync.pipeline import CompressionPipeline

# What comm_hook returns: DDP's (state, hook) pair.
HookPair = tuple[Any, Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]]
# convoy's names for torch's PowerSGDState arguments.
_TORCH_POWERSGD_OPTIONS = {
    "rank": "matrix_approximation_rank",
    "start_iter": "start_powerSGD_iter",
    "min_compression_rate": "min_compression_rate",
    "use_error_feedback": "use_error_feedback",
    "warm_start": "warm_start",
    "random_seed": "random_seed",
}


def hook_names() -> tuple[str, ...]:
    """Every name :func:`comm_hook` takes: the registered compressors offered as hooks
    (their ``CompressorSpec.hook_options``), then torch's PowerSGD hook."""
    return (*_hook_options(), "torch-powersgd")


def _hook_options() -> dict[str, dict[str, str]]:
    # Each convoy hook's options besides process_group and warmup_steps: the hook's name for
    # them -> build_compressor's (the compressor's defaults stay its registered builder's).
    return {name: dict(spec.hook_options) for name in compressor_names()
            if (spec := compressor_spec(name)).hook_options is not None}


class CompressedHookState:
    """What convoy's DDP hook keeps between steps: its exchange, each bucket's layout, the step's buckets.

    The exchange is built on first use, once the process group exists, so the
    pair can be made before ``init_process_group`` (Lightning builds its
    strategy first). ``traffic()`` gives the bytes sent and received so far;
    ``state_dict()`` and ``load_state_dict()`` save and restore this rank's
    error feedback (and PowerSGD's warm start) with a checkpoint. The compressor,
    its memory and the warm-up are ``pipeline``'s, the one the exchange runs.

    Args:
        compressor: how a bucket's gradient is put on the wire.
        memory: its error-feedback memory, keyed by bucket index.
        process_group: the group DDP averages over; ``None`` is the default group.
        warmup_steps: exchange this many first steps of each bucket uncompressed
            (sparse compressors: with a density ramp, see :class:`convoy.sync.AllReduce`).

    Example::

        >>> state = CompressedHookState(*build_compressor("topk", element_fraction=0.01))
        >>> ddp_model.register_comm_hook(state, compressed_hook)
    """

    def __init__(self, compressor: Compressor, memory: Memory,
                 process_group: dist.ProcessGroup | None = None, warmup_steps: int = 0):
        # The same error feedback, compression and warm-up as convoy train's exchange, kept across
        # the exchanges the hook builds (and saved by state_dict).
        self.pipeline = CompressionPipeline(compressor, memory, warmup_steps)
        self.process_group = process_group
        self._exchange: AllReduce | None = None
        # Each parameter's key (the order the hook first saw them in); each bucket's keys and shapes.
        self._keys: dict[int, int] = {}
        self._parameters: list[torch.Tensor] = []
        self._members: dict[int, tuple[tuple[int, ...], tuple[torch.Size, ...]]] = {}
        self._steps = 0                                   # steps whose every bucket was exchanged
        # This step: buckets handed over but not started (one before them is missing), the
        # exchanges started (position = bucket index), and the last bucket's index once seen.
        self._waiting: dict[int, tuple[dist.GradBucket, torch.futures.Future]] = {}
        self._started: list[tuple[PendingSync, torch.futures.Future, list[tuple[int, int]] | None]] = []
        self._last: int | None = None

    @property
    def exchange(self) -> AllReduce:
        """The exchange the hook runs: convoy's AllReduce over ``process_group``."""
        if self._exchange is None:
            self._exchange = AllReduce(self.process_group, pipeline=self.pipeline)
            self._exchange.set_step(self._steps)
        return self._exchange

    def bucket_layout(self, bucket: dist.GradBucket) -> tuple[tuple[torch.Size, ...], list[tuple[int, int]] | None]:
        """The shapes of ``bucket``'s parameters in the hook's own order, and where each lies in DDP's buffer.

        The hook's order is the order in which it first saw the parameters; the
        spans (offset, size) are None where DDP's order is the same. DDP regroups
        its buckets after the first iteration, mostly reordering them: the
        exchange always sees a bucket's parameters in one order, so its residuals
        and warm start stay valid, and a run resumed from :meth:`state_dict` (whose
        first iteration has DDP's initial order again) continues exactly. A bucket
        whose parameters changed starts its residual and warm start afresh.
        """
        params = bucket.parameters()
        keys = [self._key(p) for p in params]
        order = sorted(range(len(params)), key=keys.__getitem__)
        members = (tuple(keys[i] for i in order), tuple(params[i].shape for i in order))
        index = bucket.index()
        if self._members.get(index, members) != members:
            self.pipeline.forget(str(index))
        self._members[index] = members
        if order == sorted(order):
            return members[1], None
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        return members[1], [(offsets[i], params[i].numel()) for i in order]

    def _key(self, parameter: torch.Tensor) -> int:
        key = self._keys.get(id(parameter))
        if key is None:
            key = self._keys[id(parameter)] = len(self._keys)
            self._parameters.append(parameter)   # its id stays its own while the state lives
        return key

    def traffic(self) -> tuple[int, int]:
        """Bytes this rank has sent and received through the hook."""
        return self.exchange.traffic()

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state, for ``torch.save`` next to the model and optimizer.

        The error-feedback residuals differ between ranks: save one file per rank.
        Holds tensors, ints and shapes only (``torch.load`` with ``weights_only=True`` reads it).

        Example::

            >>> torch.save(state.state_dict(), f"hook.{dist.get_rank()}.pt")
        """
        if self._waiting or self._started:
            raise RuntimeError("state_dict() during a backward pass: call it between steps")
        return {"steps": self._steps,
                "buckets": {index: {"keys": list(keys), "shapes": [list(s) for s in shapes]}
                            for index, (keys, shapes) in self._members.items()},
                "tensors": self.pipeline.state_tensors()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, what :meth:`state_dict` returned on this rank.

        Register the state on a new DDP model built as the saved one was (same
        model, same bucket options): DDP then builds the same buckets, and the run
        continues as if it had not stopped. A bucket whose parameters differ from
        the saved ones starts its error feedback afresh.

        Example::

            >>> state.load_state_dict(torch.load(f"hook.{dist.get_rank()}.pt"))
        """
        self._steps = int(state["steps"])
        self._members = {int(index): (tuple(int(k) for k in bucket["keys"]),
                                      tuple(torch.Size(shape) for shape in bucket["shapes"]))
                         for index, bucket in state["buckets"].items()}
        self.pipeline.load_state_tensors(state["tensors"])
        if self._exchange is not None:
            self._exchange.set_step(self._steps)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Take one bucket of this step: start the buckets now due, in index order; finish the step on the last.

        DDP waits on the futures only after it has handed over every bucket, so
        completing them all in the call that brings the last one is in time.
        """
        index = bucket.index()
        if index < len(self._started) or index in self._waiting:
            # A bucket seen twice: the last step's backward pass ended early (an error).
            # Its collectives were issued on every rank alike; let them end before going on.
            self._finish(complete=False)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._waiting[index] = (bucket, future)
        while len(self._started) in self._waiting:   # the next index due has arrived: start it
            due, due_future = self._waiting.pop(len(self._started))
            shapes, spans = self.bucket_layout(due)
            grad = due.buffer() if spans is None else torch.cat([due.buffer()[o:o + n] for o, n in spans])
            self._started.append((self.exchange.start_flat(due.index(), shapes, grad), due_future, spans))
        if bucket.is_last():
            self._last = index
        if self._last is not None and len(self._started) > self._last:
            self._finish(complete=True)
        return future

    def _finish(self, complete: bool) -> None:
        """Wait for every collective started this step, in order; set the futures (``complete``)."""
        for pending, future, spans in self._started:
            average = pending.wait()
            if complete:
                future.set_result(average if spans is None else _unpermute(average, spans))
        if complete:
            self._steps += 1
        self._started = []
        self._waiting.clear()
        self._last = None


def _unpermute(flat: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``flat`` (parameters in the hook's order) put back where each lies in DDP's buffer (``spans``)."""
    out, position = torch.empty_like(flat), 0
    for offset, numel in spans:
        out[offset:offset + numel] = flat[position:position + numel]
        position += numel
    return out


def compressed_hook(state: CompressedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: compress, exchange and average one bucket's flat gradient.

    Args:
        state: the hook's :class:`CompressedHookState`.
        bucket: the bucket DDP hands over; its ``buffer()`` is the flat gradient.

    Returns:
        A future of the averaged flat gradient, the shape of ``bucket.buffer()``;
        it is complete once the step's last bucket has been handed over.

    Example::

        >>> ddp_model.register_comm_hook(CompressedHookState(*build_compressor("fp16")), compressed_hook)
    """
    return state.run(bucket)


class TorchPowerSGDState(powerSGD_hook.PowerSGDState):
    """torch's ``PowerSGDState`` with ``state_dict()`` / ``load_state_dict()`` like convoy's hook state.

    torch's hook chains its all-reduces through callbacks on the backend's
    threads: with several buckets under gloo, ranks can issue them in different
    orders and hang. Use ``"powersgd"`` (convoy's) there.
    """

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        """Every slot but the process group; the random generator as its state (tensors and numbers)."""
        state = {slot: getattr(self, slot) for slot in powerSGD_hook.PowerSGDState.__slots__
                 if slot not in ("process_group", "rng")}
        kind, keys, position, has_gauss, gauss = self.rng.get_state()
        state["rng"] = (kind, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, what :meth:`state_dict` returned on this rank."""
        for slot, value in state.items():
            if slot == "rng":
                kind, keys, position, has_gauss, gauss = value
                self.rng.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, gauss))
            else:
                setattr(self, slot, value)


def comm_hook(name: str, *, process_group: dist.ProcessGroup | None = None,
              **options: Any) -> HookPair:
    """The ``(state, hook)`` pair of a DDP communication hook.

    Every hook issues its collectives in bucket order on the thread that runs the
    backward pass and completes its futures there (safe under gloo with any number of
    buckets); every state has ``state_dict()`` / ``load_state_dict()``, per rank.

    Args:
        name: one of :func:`hook_names`. ``"blocktopk"``, ``"topk"``, ``"fp16"`` and ``"powersgd"``
            (and any registered compressor with ``hook_options``) run convoy's
            compressors with error feedback (powersgd: warm-started power
            iteration, as ``convoy train --compress powersgd``);
            ``"torch-powersgd"`` is torch's own PowerSGD hook
            (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, state a
            :class:`TorchPowerSGDState`), which can hang under gloo with several buckets.
        process_group: the group DDP averages over; ``None`` is the default group.
        **options: blocktopk: ``block_fraction`` or ``blocks_per_layer``,
            ``block_metric`` (l1, l2), ``block_selection`` (local, global);
            topk: ``element_fraction``; powersgd: ``rank`` (default: convoy
            train's ``--powersgd-rank``); those four also ``warmup_steps`` (steps
            of each bucket sent dense first, or with a density ramp).
            torch-powersgd: ``rank`` (default 1), ``start_iter`` (plain
            all-reduce before it; default 2, the least torch allows),
            ``min_compression_rate``, ``use_error_feedback``, ``warm_start``, ``random_seed``.

    Raises:
        UsageError: (a ValueError) an unknown name, an option the hook does not take,
            or a bad value; one line naming the valid ones.

    Example::

        >>> state, hook = comm_hook("powersgd", rank=4)
        >>> ddp_model.register_comm_hook(state, hook)
        >>> DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)   # Lightning, same pair
    """
    if name == "torch-powersgd":
        return _torch_powersgd(process_group, options)
    hooks = _hook_options()
    if name not in hooks:
        raise UsageError(f"unknown comm hook {name!r}; choose one of: {', '.join(hook_names())}")
    names = hooks[name]
    _check_options(name, options, (*names, "warmup_steps"))
    warmup_steps = options.pop("warmup_steps", 0)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UsageError(f"comm hook {name!r}: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    try:
        compressor, memory = build_compressor(name, **{names[key]: value for key, value in options.items()})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"comm hook {name!r}: {exc}") from None
    return CompressedHookState(compressor, memory, process_group, warmup_steps), compressed_hook


def _torch_powersgd(process_group: dist.ProcessGroup | None, options: dict[str, Any]) -> HookPair:
    _check_options("torch-powersgd", options, tuple(_TORCH_POWERSGD_OPTIONS))
    settings = {_TORCH_POWERSGD_OPTIONS[key]: value for key, value in options.items()}
    settings.setdefault("start_powerSGD_iter", 2)
    try:
        state = TorchPowerSGDState(process_group=process_group, **settings)
    except ValueError as exc:
        raise UsageError(f"comm hook 'torch-powersgd': {exc}") from None
    return state, powerSGD_hook.powerSGD_hook


def _check_options(name: str, options: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UsageError(f"comm hook {name!r} takes no option {', '.join(unknown)}; "
                         f"it takes: {', '.join(allowed) or 'none'} (and process_group)")


__all__ = ["CompressedHookState", "TorchPowerSGDState", "comm_hook", "compressed_hook", "hook_names"]
