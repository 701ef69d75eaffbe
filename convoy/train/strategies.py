"""The one list of ``--sync`` strategies (:mod:`convoy.train.registry` says why it is here).

Example::

    >>> from convoy.train.strategies import STRATEGIES, StrategySpec
    >>> STRATEGIES.spec("ps").spreads_step
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from convoy.train.registry import Registry

# The callables take the job's TrainConfig; it is not named here, since the config's sections read
# this module (an annotation would close an import cycle).


@dataclass(frozen=True)
class StrategySpec:
    """What a training job does differently under one ``--sync`` strategy.

    Args:
        name: its ``--sync`` name.
        syncs: a strategy that runs inside the layout's engines: ``(config, ctx, shape,
            total_steps) -> make``, where ``make(group, compressor, memory)`` is one engine's
            :class:`~convoy.sync.SyncStrategy`; called once on every rank before the layout is
            built (hierarchical plans its clusters there, a collective).
        layouts: a strategy that lays out the job itself (ps: server and worker ranks): the
            ``--parallel`` layouts it builds, by name: ``(config, model, ctx, total_steps,
            input_shape, groups, scaler) -> ParallelLayout``; the others are refused with it.
            Exactly one of ``syncs`` and ``layouts`` is given.
        options: the :class:`~convoy.train.sections.SyncConfig` fields only it reads; one
            given with another strategy (away from its default) is refused.
        check: ``(config, world) -> None``: its checks of the whole job (UsageError).
        shape: ``config -> dict``: its :class:`~convoy.parallel.shape.JobShape` arguments
            (``servers``: the ranks it adds; ``clusters``).
        groups: ``config -> dict``: the :meth:`~convoy.parallel.groups.ProcessGroups.create`
            arguments of the groups it needs besides the engines' (ps: its channels).
        spreads_step: a step's gradient is spread over several ranks (the servers' shards), so
            clipping and fp16 loss scaling need the whole-step group.
        record: ``config -> dict``: what a checkpoint's job record says of it besides its name.
        remap: how its checkpoint (under a layout whose state is the strategy's) goes on with
            another number of workers: :class:`convoy.train.elastic.Remap` ``-> (step, logged
            steps trained again, residual values dealt to float32 only, what was done)``; None:
            it resumes only on the world that wrote it.

    Example::

        >>> STRATEGIES.register(StrategySpec("gossip", syncs=gossip_syncs))
    """

    name: str
    syncs: Callable[..., Callable[..., Any]] | None = None
    layouts: Mapping[str, Callable[..., Any]] | None = None
    options: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    shape: Callable[..., dict[str, Any]] | None = None
    groups: Callable[..., dict[str, Any]] | None = None
    spreads_step: bool = False
    record: Callable[..., dict[str, Any]] | None = None
    remap: Callable[..., tuple[int, int, int, str]] | None = None

    def __post_init__(self) -> None:
        if (self.syncs is None) == (self.layouts is None):
            raise ValueError(f"--sync {self.name!r}: give syncs (it runs in the layout's engines) or layouts "
                             "(it lays out the job itself), one of them")


STRATEGIES: Registry[StrategySpec] = Registry("sync")

__all__ = ["STRATEGIES", "StrategySpec"]
