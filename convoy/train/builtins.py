"""The built-in ``--sync`` strategies and ``--parallel`` layouts, registered in the order help lists them.

Each spec names what the job does differently under it (:mod:`convoy.train.registry`): the
builders and checks live with the code they belong to (:mod:`convoy.train.hierarchical`,
:mod:`convoy.train.ps`, the elastic mappings in :mod:`convoy.train.elastic`); the two
layouts and all-reduce, a few lines each, are here. :mod:`convoy.train` imports this
module, so the registries are full wherever a job's config is read.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from convoy import runtime
from convoy.engine import Engine
from convoy.engine.gradients import LossScaler
from convoy.errors import UsageError
from convoy.parallel import DataParallel, HybridParallel, HybridRoles, ParallelLayout
from convoy.parallel.groups import ProcessGroups
from convoy.parallel.shape import JobShape
from convoy.sync import AllReduce
from convoy.train.config import TrainConfig
from convoy.train.elastic import remap_clusters, remap_ranks, remap_roles, remap_servers
from convoy.train.hierarchical import check_hierarchical, hierarchical_shape, hierarchical_syncs
from convoy.train.layouts import LAYOUTS, LayoutSpec
from convoy.train.ps import build_hybrid_ps_layout, build_ps_layout, check_ps, ps_groups, ps_record, ps_shape
from convoy.train.strategies import STRATEGIES, StrategySpec

MakeEngine = Callable[[nn.Module, "dist.ProcessGroup | None"], Engine]


def allreduce_syncs(config: TrainConfig, ctx: runtime.Context, shape: JobShape,
                    total_steps: int) -> Callable[..., AllReduce]:
    """Each engine all-reduces its (compressed) gradients over its own group."""
    return lambda group, compressor, memory: AllReduce(group, compressor, memory, config.compress.warmup())


def build_data(config: TrainConfig, model: nn.Module, ctx: runtime.Context, input_shape: tuple[int, ...],
               shape: JobShape, groups: ProcessGroups, scaler: LossScaler | None,
               make_engine: MakeEngine) -> ParallelLayout:
    """Every rank trains the whole model; its engine's group of its own keeps the engine's
    collectives from interleaving with the training loop's (evaluation, bookkeeping)."""
    return DataParallel(model, make_engine(model, groups.engines[0]), ctx.rank, ctx.world_size,
                        grad_accum=config.optim.grad_accum, amp=config.optim.amp, scaler=scaler)


def build_hybrid(config: TrainConfig, model: nn.Module, ctx: runtime.Context, input_shape: tuple[int, ...],
                 shape: JobShape, groups: ProcessGroups, scaler: LossScaler | None,
                 make_engine: MakeEngine) -> ParallelLayout:
    """The conv layers data-parallel on the conv workers, the FC head on the FC workers."""
    return HybridParallel(model, shape.hybrid_roles(), ctx.rank, input_shape, make_engine, config.parallel.split_at,
                          sub_batches=config.parallel.sub_batches, grad_accum=config.optim.grad_accum,
                          amp=config.optim.amp, scaler=scaler, engine_groups=groups.engines)


def hybrid_roles(config: TrainConfig) -> dict[str, Any]:
    """The conv and FC workers (the job's shape and a checkpoint's record both hold them)."""
    return {"conv_workers": config.parallel.conv_workers or 0, "fc_workers": config.parallel.fc_workers or 0}


def check_hybrid(config: TrainConfig, world: int) -> None:
    """``--parallel hybrid``'s checks of the whole job (UsageError, one line)."""
    parallel = config.parallel
    if parallel.conv_workers is None or parallel.fc_workers is None:
        raise UsageError("--parallel hybrid needs --conv-workers I and --fc-workers J")
    HybridRoles(parallel.conv_workers, parallel.fc_workers)   # its own checks
    if parallel.sub_batches > config.data.batch_size:
        raise UsageError(f"--sub-batches ({parallel.sub_batches}) must be at most --batch-size "
                         f"({config.data.batch_size})")


STRATEGIES.register(StrategySpec("allreduce", syncs=allreduce_syncs, remap=remap_ranks))
STRATEGIES.register(StrategySpec("hierarchical", syncs=hierarchical_syncs, check=check_hierarchical,
                                 options=("clusters", "indicator_weights", "node_profile"),
                                 shape=hierarchical_shape, remap=remap_clusters))
STRATEGIES.register(StrategySpec("ps", layouts={"data": build_ps_layout, "hybrid": build_hybrid_ps_layout},
                                 options=("servers", "staleness", "shard_weights", "channels", "priority", "slice_kb",
                                          "credit_kb", "trace"),
                                 check=check_ps, shape=ps_shape, groups=ps_groups, spreads_step=True,
                                 record=ps_record, remap=remap_servers))
LAYOUTS.register(LayoutSpec("data", build_data, remap_by_strategy=True))
LAYOUTS.register(LayoutSpec("hybrid", build_hybrid, options=("conv_workers", "fc_workers", "sub_batches"),
                            check=check_hybrid, shape=hybrid_roles, spreads_step=True, record=hybrid_roles,
                            remap={"allreduce": remap_roles}, worker="conv worker"))
