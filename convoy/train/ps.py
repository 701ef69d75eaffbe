"""The parameter-server layouts of a training job (``--sync ps``, data or hybrid parallel), from a TrainConfig."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from typing import Any

from convoy import runtime
from convoy.engine import Engine
from convoy.engine.gradients import GradientGate, LossScaler
from convoy.errors import UsageError
from convoy.models import split_point
from convoy.parallel import HybridParallel, HybridRoles, ParallelLayout
from convoy.parallel.groups import ProcessGroups
from convoy.parallel.ps import HybridServer, ParameterServerLayout, worker_engine
from convoy.ps.job import build_job
from convoy.ps.push import RowCodec
from convoy.ps.settings import PSSettings
from convoy.ps.timeline import Timeline
from convoy.ps.trace_graph import model_layers
from convoy.sync.pipeline import CompressionPipeline
from convoy.train.config import TrainConfig
from convoy.train.optim import build_compression, lr_lambda, optimizer_spec


def ps_settings(config: TrainConfig) -> PSSettings:
    sync = config.sync
    return PSSettings.resolve(config.ps_servers(), sync.priority, sync.channels, sync.slice_kb, sync.credit_kb,
                              sync.trace_steps if sync.trace else 0, sync.staleness, sync.shard_weights)


def ps_shape(config: TrainConfig) -> dict[str, Any]:
    """The job's dedicated server ranks (colocated servers are workers too: no ranks of their own)."""
    servers = config.ps_servers()
    return {"servers": 0 if servers == "colocated" else int(servers)}


def ps_groups(config: TrainConfig) -> dict[str, Any]:
    """The channels (and their acknowledgements) between servers and workers, created with the job's groups."""
    return {"ps": ps_settings(config)}


def ps_record(config: TrainConfig) -> dict[str, Any]:
    """What a checkpoint records of the servers (a resume elsewhere needs the same kind)."""
    return {"servers": config.ps_servers()}


def check_ps(config: TrainConfig, world: int) -> None:
    """``--sync ps``'s checks of the whole job on ``world`` processes (UsageError, one line).

    The layouts are named here because ps builds both itself: its data-parallel one
    (colocated or dedicated servers) and its hybrid one (dedicated servers after the roles).
    """
    servers = config.ps_servers()
    if servers == "colocated":
        _check_colocated(config, world)
    else:
        for flag, given in (("--staleness", config.sync.staleness), ("--shard-weights", config.sync.shard_weights)):
            if given:
                raise UsageError(f"{flag} needs --servers colocated")
    if servers != "colocated" and servers >= world:
        raise UsageError(f"--servers ({servers}) must be smaller than the number of processes ({world}): "
                         "at least one rank must be a worker")
    conv, fc = config.parallel.conv_workers, config.parallel.fc_workers
    if config.parallel.layout == "hybrid" and conv and fc and conv + fc + int(servers) != world:
        raise UsageError(f"--parallel hybrid --sync ps needs --nproc = --conv-workers + --fc-workers + --servers "
                         f"= {conv + fc + servers} (the servers are the last ranks), got {world}")
    if config.compress.block_selection == "global" and config.compress.name == "blocktopk":
        raise UsageError("--block-selection global needs every rank to agree on the blocks (an all-reduce); "
                         "a parameter server decodes each push alone: use --block-selection local with --sync ps")
    if config.checkpoint.dir is not None and (servers not in (1, "colocated") or config.parallel.layout != "data"):
        raise UsageError("--checkpoint-dir with --sync ps needs --servers colocated or 1 and --parallel data (the "
                         "workers' rank files commit in step with the servers' files)")


def _check_colocated(config: TrainConfig, world: int) -> None:
    if world < 2:
        raise UsageError(f"--servers colocated needs at least 2 processes, got {world}; give --nproc 2 or "
                         "more, or train on one process without --sync ps")
    if config.parallel.layout != "data":
        raise UsageError("--servers colocated needs --parallel data; a hybrid job takes --servers S "
                         "dedicated server ranks")
    if config.sync.staleness:
        _check_stale(config)
    weights = config.sync.shard_weights
    if weights and len(weights) != world:
        raise UsageError(f"--shard-weights needs one share per process ({world}), got {len(weights)}")
    if config.optim.clip_grad_norm is not None or config.optim.amp == "fp16":
        raise UsageError("--clip-grad-norm and --amp fp16 are not supported with --servers colocated yet; "
                         "give --servers S (dedicated servers) or leave them out")


def _check_stale(config: TrainConfig) -> None:
    staleness = f"--staleness {config.sync.staleness}"
    if config.compress.name != "none":
        raise UsageError(f"{staleness} with --compress {config.compress.name}: compressed pushes are not supported "
                         "under bounded staleness yet; give --compress none or --staleness 0")
    if config.checkpoint.dir is not None:
        raise UsageError(f"{staleness} with --checkpoint-dir: checkpoints of a stale job are not supported yet "
                         "(each rank's shard is up to S steps ahead of its worker); give --staleness 0")


def example_batch(config: TrainConfig, input_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Random inputs like a training batch (traced for the priorities), from a private generator:
    the global seed stays as it was."""
    return torch.randn(config.data.batch_size, *input_shape, generator=torch.Generator().manual_seed(0)).to(device)


def gate(config: TrainConfig, scaler: LossScaler | None, group: dist.ProcessGroup | None) -> GradientGate:
    """Clipping and fp16 unscaling on the servers, whose shards' norms ``group`` (every rank) sums; the
    workers join the same sum with nothing, and so learn each step's skip decision."""
    return GradientGate(config.optim.clip_grad_norm, scaler, group)


def build_ps_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int,
                    input_shape: tuple[int, ...], groups: ProcessGroups,
                    scaler: LossScaler | None = None) -> ParameterServerLayout:
    """This rank's server or worker, with the settings of ``config`` (``groups``: the job's, created with
    them; ``scaler``: fp16's, one per rank)."""
    settings = ps_settings(config)
    optimizer_class, hyper = optimizer_spec(config)
    workers = ctx.world_size if settings.colocated else ctx.world_size - settings.servers
    compressor, memory = build_compression(config, workers)
    return ParameterServerLayout(model, settings, ctx.rank, ctx.world_size, optimizer_class, hyper,
                                 example_batch(config, input_shape, ctx.device),
                                 lr_lambda(config.optim.lr_schedule, total_steps), compressor=compressor, memory=memory,
                                 warmup_steps=config.compress.warmup(), grad_accum=config.optim.grad_accum,
                                 amp=config.optim.amp, scaler=scaler,
                                 gate=gate(config, scaler, groups.whole_step), groups=groups)


def build_hybrid_ps_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int,
                           input_shape: tuple[int, ...], groups: ProcessGroups,
                           scaler: LossScaler | None = None) -> ParallelLayout:
    """Hybrid parallelism whose two groups exchange through parameter servers (the job's last ranks).

    Conv ranks push the conv layers and FC ranks the head, each to the layer's
    server; each layer is averaged over the group that trains it. The servers
    are the last ``--servers`` ranks, so the conv and FC ranks stay where the
    hybrid layout puts them.
    """
    settings = ps_settings(config)
    roles = HybridRoles(config.parallel.conv_workers, config.parallel.fc_workers)
    conv_ranks = list(range(roles.conv_workers))
    fc_ranks = list(range(roles.conv_workers, roles.world_size))
    features, _ = split_point(model, config.parallel.split_at)
    in_features = {id(m) for m in features.modules()}
    if groups.channels is None:
        raise ValueError("the job's groups were created without its ps settings")
    ps_roles = groups.channels.roles
    layer_workers = [conv_ranks if id(module) in in_features else fc_ranks for _, module, _ in model_layers(model)]
    optimizer_class, hyper = optimizer_spec(config)
    compressor, memory = build_compression(config, roles.conv_workers)
    schedule = lr_lambda(config.optim.lr_schedule, total_steps)
    codec = RowCodec(CompressionPipeline(compressor, None, config.compress.warmup()))
    job = build_job(model, groups.channels, settings, example_batch(config, input_shape, ctx.device), codec,
                    layer_workers)
    timeline = (Timeline(ctx.rank, "server" if ps_roles.is_server(ctx.rank) else "worker", settings.trace_steps)
                if settings.trace_steps else None)
    if ps_roles.is_server(ctx.rank):
        return HybridServer(job, ctx.rank, conv_ranks, fc_ranks, optimizer_class, hyper, schedule, timeline,
                            gate(config, scaler, groups.whole_step))

    def make_engine(part: nn.Module, group: dist.ProcessGroup) -> Engine:
        part_compressor, part_memory = build_compression(config, dist.get_world_size(group))
        # ``group`` is exactly the workers of ``part``'s layers, and the engine's own: PowerSGD agrees over it.
        return worker_engine(job, ctx.rank, part, optimizer_class, hyper, schedule, part_compressor, part_memory,
                             config.compress.warmup(), timeline, group, gate(config, scaler, groups.whole_step))

    return HybridParallel(model, roles, ctx.rank, input_shape, make_engine, config.parallel.split_at,
                          sub_batches=config.parallel.sub_batches, servers=settings.servers, grad_accum=config.optim.grad_accum,
                          amp=config.optim.amp, scaler=scaler, engine_groups=groups.engines)
