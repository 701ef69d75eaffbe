"""The one list of ``--parallel`` layouts (:mod:`convoy.train.registry` says why it is here).

Example::

    >>> from convoy.train.layouts import LAYOUTS, LayoutSpec
    >>> LAYOUTS.names()
    ('data', 'hybrid')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from convoy.train.registry import Registry


@dataclass(frozen=True)
class LayoutSpec:
    """What a training job does differently under one ``--parallel`` layout.

    Args:
        name: its ``--parallel`` name.
        build: ``(config, model, ctx, input_shape, shape, groups, scaler, make_engine) ->
            ParallelLayout``: this rank's layout, its engines made by ``make_engine(part,
            group)`` (the strategy's sync, the compressor, the gate); a strategy that lays
            out the job itself (:attr:`StrategySpec.layouts`) builds it instead.
        options: the :class:`~convoy.train.sections.ParallelConfig` fields only it reads;
            one given with another layout (away from its default) is refused.
        check: ``(config, world) -> None``: its checks of the whole job (UsageError).
        shape: ``config -> dict``: its :class:`~convoy.parallel.shape.JobShape` arguments.
        spreads_step: a step's gradient is spread over several engines (hybrid: the conv
            group's and the FC group's), so clipping and fp16 loss scaling need the
            whole-step group.
        record: ``config -> dict``: what a checkpoint's job record says of it besides its name.
        remap: how a checkpoint of it goes on with another number of workers, by ``--sync``
            name (:attr:`StrategySpec.remap`'s form); a strategy it does not name resumes only
            on the world that wrote it.
        remap_by_strategy: its state is the strategy's alone (data parallelism), so the
            strategy's own :attr:`StrategySpec.remap` maps it (``remap`` is not read).
        worker: what one of its data ranks is called in messages ("conv worker").

    Example::

        >>> LAYOUTS.register(LayoutSpec("pipeline", build_pipeline, options=("stages",)))
    """

    name: str
    build: Callable[..., Any]
    options: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    shape: Callable[..., dict[str, Any]] | None = None
    spreads_step: bool = False
    record: Callable[..., dict[str, Any]] | None = None
    remap: Mapping[str, Callable[..., tuple[int, int, int, str]]] | None = None
    remap_by_strategy: bool = False
    worker: str = "worker"


LAYOUTS: Registry[LayoutSpec] = Registry("parallel")

__all__ = ["LAYOUTS", "LayoutSpec"]
