"""Which process groups a training job needs, from its TrainConfig; :mod:`convoy.parallel.groups` creates them."""
from __future__ import annotations

from convoy.parallel.groups import ProcessGroups
from convoy.parallel.shape import JobShape
from convoy.train.config import TrainConfig
from convoy.train.optim import needs_whole_step


def job_groups(config: TrainConfig, shape: JobShape) -> ProcessGroups:
    """Every process group of the job ``config`` describes on ``shape``; a collective: call it once on
    every rank (hierarchical sync's clusters come later, from :func:`convoy.train.hierarchical.build_hierarchy`).

    Example::

        >>> shape = config.job_shape(dist.get_world_size())
        >>> groups = job_groups(config, shape)
    """
    checkpointing = config.checkpoint.dir is not None
    strategy = config.strategy_spec()
    return ProcessGroups.create(shape, whole_step=needs_whole_step(config, shape.world_size), bookkeeping=True,
                                **(strategy.groups(config) if strategy.groups is not None else {}),
                                agree_every=checkpointing and config.checkpoint.every == "auto",
                                agree_full=checkpointing and config.checkpoint.full_every == "auto")
