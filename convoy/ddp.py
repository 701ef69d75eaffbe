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
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations
# against the real dist.GradBucket and Future[Tensor] objects, not strings.
from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy.compress import Compressor, Memory, build_compressor
from convoy.errors import UsageError
from convoy.sync import AllReduce

# What comm_hook returns: DDP's (state, hook) pair.
HookPair = tuple[Any, Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]]
# The options each hook takes besides process_group (and warmup_steps for convoy's own).
_CONVOY_OPTIONS: dict[str, tuple[str, ...]] = {
    "blocktopk": ("block_fraction", "blocks_per_layer", "block_metric", "block_selection"),
    "topk": ("element_fraction",),
    "fp16": (),
}
# convoy's names for torch's PowerSGDState arguments.
_POWERSGD_OPTIONS = {
    "rank": "matrix_approximation_rank",
    "start_iter": "start_powerSGD_iter",
    "min_compression_rate": "min_compression_rate",
    "use_error_feedback": "use_error_feedback",
    "warm_start": "warm_start",
    "random_seed": "random_seed",
}
HOOK_NAMES: tuple[str, ...] = (*_CONVOY_OPTIONS, "powersgd")


class CompressedHookState:
    """What convoy's DDP hook keeps between steps: its exchange and each bucket's layout.

    The exchange is built on first use, once the process group exists, so the
    pair can be made before ``init_process_group`` (Lightning builds its
    strategy first). ``traffic()`` gives the bytes sent and received so far.

    Args:
        compressor: how a bucket's gradient is put on the wire.
        memory: its error-feedback memory, keyed by bucket index.
        process_group: the group DDP averages over; ``None`` is the default group.
        warmup_steps: exchange this many first steps of each bucket uncompressed.

    Example::

        >>> state = CompressedHookState(*build_compressor("topk", element_fraction=0.01))
    """

    def __init__(self, compressor: Compressor, memory: Memory,
                 process_group: dist.ProcessGroup | None = None, warmup_steps: int = 0):
        self.compressor, self.memory = compressor, memory
        self.process_group, self.warmup_steps = process_group, warmup_steps
        self._exchange: AllReduce | None = None
        self._shapes: dict[int, tuple[torch.Size, ...]] = {}

    @property
    def exchange(self) -> AllReduce:
        """The exchange the hook runs: convoy's AllReduce over ``process_group``."""
        if self._exchange is None:
            self._exchange = AllReduce(self.process_group, self.compressor, self.memory, self.warmup_steps)
        return self._exchange

    def bucket_shapes(self, bucket: dist.GradBucket) -> tuple[torch.Size, ...]:
        """The shapes of ``bucket``'s parameters; forgets the bucket's residual when they changed.

        DDP regroups its buckets after the first iteration, so an index may
        name other parameters from then on; an old residual would not fit.
        """
        index, shapes = bucket.index(), tuple(p.shape for p in bucket.parameters())
        if self._shapes.get(index, shapes) != shapes:
            self.memory.forget(str(index))
        self._shapes[index] = shapes
        return shapes

    def traffic(self) -> tuple[int, int]:
        """Bytes this rank has sent and received through the hook."""
        return self.exchange.traffic()


def compressed_hook(state: CompressedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: compress, exchange and average one bucket's flat gradient.

    Args:
        state: the hook's :class:`CompressedHookState`.
        bucket: the bucket DDP hands over; its ``buffer()`` is the flat gradient.

    Returns:
        A future of the averaged flat gradient, the shape of ``bucket.buffer()``.

    Example::

        >>> ddp_model.register_comm_hook(CompressedHookState(*build_compressor("fp16")), compressed_hook)
    """
    shapes = state.bucket_shapes(bucket)
    return state.exchange.start_flat(bucket.index(), shapes, bucket.buffer()).future()


def comm_hook(name: str, *, process_group: dist.ProcessGroup | None = None,
              **options: Any) -> HookPair:
    """The ``(state, hook)`` pair of a DDP communication hook.

    Args:
        name: ``"blocktopk"``, ``"topk"`` and ``"fp16"`` run convoy's compressors
            (with error feedback); ``"powersgd"`` is torch's own PowerSGD hook
            (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``,
            state a ``PowerSGDState``).
        process_group: the group DDP averages over; ``None`` is the default group.
        **options: blocktopk: ``block_fraction`` or ``blocks_per_layer``,
            ``block_metric`` (l1, l2), ``block_selection`` (local, global);
            topk: ``element_fraction``; those three also ``warmup_steps``
            (steps of each bucket sent dense first). powersgd: ``rank`` (default 1),
            ``start_iter`` (plain all-reduce before it; default 2, the least
            torch allows), ``min_compression_rate``, ``use_error_feedback``,
            ``warm_start``, ``random_seed``.

    Raises:
        UsageError: an unknown name, an option the hook does not take, or a bad value.

    Example::

        >>> ddp_model.register_comm_hook(*comm_hook("blocktopk", block_fraction=0.01))
        >>> DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)   # Lightning, same pair
    """
    if name == "powersgd":
        return _powersgd(process_group, options)
    if name not in _CONVOY_OPTIONS:
        raise UsageError(f"unknown comm hook {name!r}; choose one of: {', '.join(HOOK_NAMES)}")
    warmup_steps = options.pop("warmup_steps", 0)
    _check_options(name, options, _CONVOY_OPTIONS[name] + ("warmup_steps",))
    try:
        compressor, memory = build_compressor(name, **options)
        return CompressedHookState(compressor, memory, process_group, warmup_steps), compressed_hook
    except (TypeError, ValueError) as exc:
        raise UsageError(f"comm hook {name!r}: {exc}") from None


def _powersgd(process_group: dist.ProcessGroup | None, options: dict[str, Any]) -> HookPair:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    _check_options("powersgd", options, tuple(_POWERSGD_OPTIONS))
    settings = {_POWERSGD_OPTIONS[key]: value for key, value in options.items()}
    settings.setdefault("start_powerSGD_iter", 2)
    try:
        state = powerSGD_hook.PowerSGDState(process_group=process_group, **settings)
    except ValueError as exc:
        raise UsageError(f"comm hook 'powersgd': {exc}") from None
    return state, powerSGD_hook.powerSGD_hook


def _check_options(name: str, options: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UsageError(f"comm hook {name!r} takes no option {', '.join(unknown)}; "
                         f"it takes: {', '.join(allowed) or 'none'} (and process_group)")


__all__ = ["HOOK_NAMES", "CompressedHookState", "comm_hook", "compressed_hook"]
