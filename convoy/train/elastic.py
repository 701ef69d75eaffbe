"""Resuming a checkpoint on another number of workers: keep its global batch, map its state onto the new world.

``convoy train`` with another ``--nproc`` (or under torchrun's re-formed world)
on a ``--checkpoint-dir`` that ``N`` workers wrote goes on with ``M``: rank 0
checks that the job can be mapped (the checkpoint's global batch divides over
the new world's data workers, the same model, the same kind of job) and maps
its state (every rank then trains on with ``global batch / workers`` samples a
step; global batches do not depend on the world size, so the data order
continues):

- ``--sync allreduce``: the rank files are re-dealt (:mod:`convoy.checkpoint.reshard`).
- ``--sync hierarchical``: the clusters are planned again for the new world,
  every rank starting from the old clusters' state as their next exchange would
  combine it (:mod:`convoy.train.elastic_layouts`; written once the new plan is
  made, :func:`convoy.train.hierarchical.build_hierarchy`).
- ``--sync ps`` (``--servers colocated`` or ``1``): the parameters and optimizer
  state re-sharded onto the new servers, the workers' state re-dealt
  (:mod:`convoy.train.elastic_ps`).
- ``--parallel hybrid``: the layout given for the new world is checked, and the
  state maps by role (:mod:`convoy.train.elastic_layouts`).

Anything else is refused in one line before a byte of the checkpoint changes.

Example::

    >>> config = adapt_to_checkpoint(config, model, ctx)   # config.data.batch_size: global / workers
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy import runtime
from convoy.checkpoint.files import model_file
from convoy.checkpoint.reshard import STAGING, Rebuild, cleanup, commit_deal, complete, plan_deal
from convoy.checkpoint.snapshot import model_layout
from convoy.checkpoint.written import JobRecord, check_model_file, rank_files, recorded_job
from convoy.errors import UsageError
from convoy.models import split_point
from convoy.train.config import TrainConfig
from convoy.train.elastic_layouts import plan_replan, relayout_hybrid
from convoy.train.elastic_ps import reshard_ps
from convoy.train.layouts import LAYOUTS
from convoy.train.optim import optimizer_spec
from convoy.train.strategies import STRATEGIES

# What a mapping returns: (step, logged steps trained again, residual values dealt only to float32, what was done).
Mapped = tuple[int, int, int, str]


@dataclass(frozen=True)
class Remap:
    """A checkpoint to go on with another number of workers: what every mapping
    (:attr:`StrategySpec.remap`, :attr:`LayoutSpec.remap`) is given.

    Args:
        directory: the checkpoint directory.
        config: the new job's settings.
        model: the new job's model (its layout is checked against the checkpoint's).
        job: what the checkpoint's records say of the job that wrote it.
        world: the new number of workers.
        nodes: each new rank's node (:func:`node_of_ranks`).
        keep: how to keep the checkpoint as it is, for refusals.
        new_job: what the new files' records say of the job.
    """

    directory: Path
    config: TrainConfig
    model: nn.Module
    job: JobRecord
    world: int
    nodes: list[int]
    keep: str
    new_job: dict[str, Any]


def mapping_of(config: TrainConfig) -> Callable[[Remap], Mapped] | None:
    """How a checkpoint of the job ``config`` describes maps onto another world: the strategy's
    mapping, under a layout whose state is the strategy's, else the layout's own for the strategy;
    None: it resumes only on the world that wrote it."""
    strategy, layout = config.strategy_spec(), config.layout_spec()
    if layout.remap_by_strategy:
        return strategy.remap
    return (layout.remap or {}).get(strategy.name)


def resumable_jobs() -> str:
    """The jobs that resume on any number of workers, as flags (from the registries)."""
    strategies = [spec.name for spec in STRATEGIES.specs() if spec.remap is not None]
    kinds = []
    for layout in LAYOUTS.specs():
        if layout.remap_by_strategy and strategies:
            kinds.append(f"--sync {_either(strategies)} with --parallel {layout.name}")
        elif layout.remap:
            kinds.append(f"--parallel {layout.name} with --sync {_either(list(layout.remap))}")
    return ", and ".join(kinds)


def _either(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def adapt_to_checkpoint(config: TrainConfig, model: nn.Module, ctx: runtime.Context) -> TrainConfig:
    """``config`` with the per-worker batch that keeps the checkpoint's global batch on this world,
    after rank 0 mapped the checkpoint's state onto it; ``config`` itself when the world is
    the checkpoint's (or there is none). A collective: every rank calls it.

    Raises:
        UsageError: on every rank, when the checkpoint cannot go on with this world (one line).
    """
    if config.checkpoint.dir is None:
        return config
    outcome: list = [None]
    nodes = node_of_ranks(ctx)
    if ctx.rank == 0:
        try:
            outcome = [_adapt(config, model, ctx.world_size, nodes)]
        except UsageError as exc:
            outcome = [("refused", str(exc))]
    else:
        # The first optimizer a process builds imports torch._dynamo (a second or more on a slow host):
        # the ranks that wait for rank 0's mapping pay for it meanwhile rather than after it.
        _warm_up_optimizer(config)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is None:
        return config
    kind, value = outcome[0]
    if kind == "refused":
        raise UsageError(value)
    batch, note = value
    if ctx.rank == 0:
        print(note, file=sys.stderr, flush=True)
    return config.with_settings(batch_size=batch)


def _warm_up_optimizer(config: TrainConfig) -> None:
    optimizer_class, hyper = optimizer_spec(config)
    optimizer_class([torch.zeros(1, requires_grad=True)], **hyper)


def finish_resharding(config: TrainConfig, rank: int) -> None:
    """After the run's last commit (rank 0): drop the old world's files a re-deal kept aside,
    if every rank file has committed a step of the new world (else the next start does)."""
    if config.checkpoint.dir is not None and rank == 0 and Path(config.checkpoint.dir).is_dir():
        cleanup(Path(config.checkpoint.dir))


def job_layout(config: TrainConfig) -> dict[str, Any]:
    """What the checkpoint's records say of the job's layout (``--sync``, ``--servers``,
    ``--parallel`` and the hybrid roles): what a resume on another world maps from."""
    layout: dict[str, Any] = {"sync": config.sync.strategy, "parallel": config.parallel.layout}
    for spec in (config.strategy_spec(), config.layout_spec()):
        if spec.record is not None:
            layout.update(spec.record(config))
    return layout


def job_record(config: TrainConfig, world: int, global_batch: int) -> dict[str, Any]:
    """What every commit record says of the job (its world, global batch and layout)."""
    return {"world": world, "global_batch": global_batch, "layout": job_layout(config)}


def node_of_ranks(ctx: runtime.Context) -> list[int]:
    """Each rank's node, named by its first rank (from torchrun's ``LOCAL_RANK``). A collective."""
    mine = ctx.rank - int(os.environ.get("LOCAL_RANK", ctx.rank))
    if not (dist.is_initialized() and ctx.world_size > 1):
        return [mine]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def writers_of(group: list[int], nodes: list[int]) -> list[int]:
    """The ranks of ``group`` that write its model file: its first on each node
    (as :func:`convoy.checkpoint.session.start_checkpointing` picks them)."""
    return sorted({min(r for r in group if nodes[r] == node) for node in {nodes[r] for r in group}})


def _adapt(config: TrainConfig, model: nn.Module, world: int, nodes: list[int]) -> tuple[str, object] | None:
    directory = Path(config.checkpoint.dir)
    if not directory.is_dir():
        return None
    if config.checkpoint.resume is False:
        # Starting over: a rank file of a rank this world lacks must not pass for part of the new job.
        for rank, path in rank_files(directory).items():
            if rank >= world:
                path.unlink()
        # Nor may a re-deal a kill interrupted be completed later over the new job's files.
        shutil.rmtree(directory / STAGING, ignore_errors=True)
        return None
    complete(directory)   # a re-deal that a kill interrupted after it was committed
    cleanup(directory)    # one the new world has committed a step after
    job = recorded_job(directory)
    if job is None:
        return None
    accum = config.optim.grad_accum
    global_batch = job.global_batch or config.data.batch_size * accum * job.world
    keep = f"run on {job.world} workers, or pass --no-resume to start over"
    mapping = mapping_of(config)
    if job.world == world:
        # A mapped job restarted with its first command (its original --batch-size) keeps the checkpoint's batch.
        data_world = config.job_shape(world).data_world_size
        return _same_world(directory, config, global_batch, data_world, keep) if mapping else None
    if mapping is None:
        raise UsageError(f"--checkpoint-dir {directory} holds a checkpoint of {job.world} workers; --parallel "
                         f"{config.parallel.layout} with --sync {config.sync.strategy} resumes only on that number "
                         f"({world} given; {resumable_jobs()} resume on any): {keep}")
    if job.layout is not None or _kind(config) != _kind(TrainConfig()):
        _check_same_kind(directory, job, config, keep)   # the default job's kind is implied when unrecorded
    data_world = config.job_shape(world).data_world_size   # the new layout fits the new world, or one line
    per = f" x --grad-accum {accum}" if accum > 1 else ""
    worker = config.layout_spec().worker
    if global_batch % (data_world * accum):
        raise UsageError(f"--checkpoint-dir {directory}: the checkpoint's global batch of {global_batch} does not "
                         f"divide over {data_world} {worker}s{per}; {keep}")
    step, retrained, inexact, what = mapping(Remap(directory, config, model, job, world, nodes, keep,
                                                   job_record(config, world, global_batch)))
    batch = global_batch // (data_world * accum)
    workers = f"{job.world} worker{'s' if job.world > 1 else ''}"
    note = (f"convoy: checkpoint: {directory} was written by {workers}; resuming on {world}: global batch "
            f"{global_batch} kept ({batch} per {worker}{' per micro-batch' if accum > 1 else ''}), {what} at "
            f"step {step}")
    if retrained:
        note += (f" (the newest step every rank file holds: the {retrained} logged steps after it are "
                 "trained again)")
    if inexact:
        note += (f"; {inexact} residual values kept their mean only to float32 precision "
                 "(their values span too wide a range to be dealt exactly)")
    return "resharded", (batch, note)


def _kind(config: TrainConfig) -> tuple[str, str]:
    return config.sync.strategy, config.parallel.layout


def remap_ranks(r: Remap) -> Mapped:
    """A data-parallel all-reduce job's checkpoint: every rank file re-dealt."""
    # The model check below builds this process's first optimizer, which imports torch._dynamo (a
    # second or more on a slow host): a thread imports it while the old files are read (reads only,
    # no imports: the main thread takes no import lock the thread could hold).
    warm = threading.Thread(target=_warm_up_optimizer, args=(r.config,), name="convoy-warm-up", daemon=True)
    warm.start()
    try:
        deal = plan_deal(r.directory, r.job.world, r.world)
    finally:
        warm.join()
    _check_model(r.directory, r.model, r.config)
    if r.job.model_files > 1:
        # Several nodes shared the directory (torchrun on several hosts): each node's writer kept a
        # model file; in a data-parallel job they are copies of one model, or this is no such job.
        _check_copies(r.directory, r.model, r.config, r.world, r.keep)
    optimizer_class, hyper = optimizer_spec(r.config)
    # Rank 0 reads the model file's log to re-deal anyway: it writes the step as a full snapshot,
    # so that no new rank has the log to apply (each would replay the same steps).
    commit_deal(r.directory, deal, r.job.world, writers_of(list(range(r.world)), r.nodes),
                Rebuild(r.model, optimizer_class, hyper, r.new_job))
    return deal.step, deal.retrained, deal.inexact, "per-rank state re-dealt"


def remap_clusters(r: Remap) -> Mapped:
    """A hierarchical job's checkpoint: the clusters planned again (:mod:`convoy.train.elastic_layouts`)."""
    _check_copies(r.directory, r.model, r.config, r.world, r.keep)   # each cluster's file holds the whole model
    replan = plan_replan(r.directory, r.job.world)                    # written once the new clusters are planned
    weights = ", ".join(f"{w:.3g}" for w in replan.weights)
    return (replan.job.step, 0, 0, f"clusters planned again, every rank starting from the {len(replan.clusters)} "
            f"old clusters' model, momentum and error-feedback state combined with the weights of their "
            f"next exchange ({weights})")


def remap_servers(r: Remap) -> Mapped:
    """A ps job's checkpoint: the servers' shards re-sharded (:mod:`convoy.train.elastic_ps`)."""
    return reshard_ps(r.directory, r.config, r.model, r.job.world, r.world,
                      writers_of(list(range(r.world)), r.nodes), r.new_job)


def remap_roles(r: Remap) -> Mapped:
    """A hybrid all-reduce job's checkpoint: each role's state re-dealt within its group."""
    old, new = r.job.layout or {}, (r.config.parallel.conv_workers, r.config.parallel.fc_workers)
    features, head = split_point(r.model, r.config.parallel.split_at)
    for rank, part, role in ((0, features, "conv layers"), (old["conv_workers"], head, "FC head")):
        _check_model(r.directory, part, r.config, model_file(r.directory, rank),
                     f" (the {role} of a --conv-workers {old['conv_workers']} --fc-workers {old['fc_workers']} job)")
    groups = (list(range(new[0])), list(range(new[0], r.world)))
    step, retrained, inexact = relayout_hybrid(r.directory, (old["conv_workers"], old["fc_workers"]), new,
                                               (writers_of(groups[0], r.nodes), writers_of(groups[1], r.nodes)),
                                               r.new_job)
    return (step, retrained, inexact, f"conv layers from {old['conv_workers']} workers to {new[0]}, FC head from "
            f"{old['fc_workers']} to {new[1]}, per-rank state re-dealt within each group")


def _flags(layout: dict[str, Any]) -> str:
    """A recorded layout as the flags that ask for it."""
    flags = f"--sync {layout.get('sync')}" + (f" --servers {layout['servers']}" if "servers" in layout else "")
    return flags + f" --parallel {layout.get('parallel')}"


def _check_same_kind(directory: Path, job: JobRecord, config: TrainConfig, keep: str) -> None:
    """UsageError unless the checkpoint recorded a layout of the kind ``config`` asks for (the
    hybrid roles may change: they are what is re-laid out)."""
    if job.layout is None:
        raise UsageError(f"--checkpoint-dir {directory} was written before convoy recorded a job's layout, so it "
                         f"cannot be mapped onto another number of workers: {keep}")
    mine = job_layout(config)
    if _flags(job.layout) != _flags(mine):
        raise UsageError(f"--checkpoint-dir {directory} was written by a `{_flags(job.layout)}` job, not "
                         f"`{_flags(mine)}`; resume it with those settings on any number of workers, or {keep}")


def _same_world(directory: Path, config: TrainConfig, global_batch: int, data_world: int,
                keep: str) -> tuple[str, object] | None:
    """None when this world's batch is the checkpoint's; else the per-worker batch that keeps it.

    A job re-dealt onto fewer workers and restarted by torchrun with its first command (the
    original --batch-size) is on the checkpoint's world again, but its global batch must stay
    the one the checkpoint was trained with, or the data order and the trajectory change.
    """
    accum = config.optim.grad_accum
    if global_batch == config.data.batch_size * accum * data_world:
        return None
    if global_batch % (data_world * accum):
        raise UsageError(f"--checkpoint-dir {directory}: the checkpoint's global batch of {global_batch} does not "
                         f"divide over {data_world} workers with --grad-accum {accum}; {keep}")
    batch = global_batch // (data_world * accum)
    return "kept", (batch, f"convoy: checkpoint: {directory} was trained with a global batch of {global_batch}: "
                           f"kept ({batch} per worker{' per micro-batch' if accum > 1 else ''}, not --batch-size "
                           f"{config.data.batch_size})")


def _check_copies(directory: Path, model: nn.Module, config: TrainConfig, world: int, keep: str) -> None:
    """UsageError unless every model file in ``directory`` holds the whole model (copies kept by
    the nodes of one data-parallel job, or a hierarchical job's clusters, not the layer groups
    of a hybrid or pipeline one)."""
    for path in sorted(directory.glob("model-rank*.ckpt")):
        try:
            _check_model(directory, model, config, path)
        except UsageError:
            raise UsageError(f"--checkpoint-dir {directory}: {path.name} does not hold the whole model (its "
                             f"model files are parts of one, not a data-parallel job's copies), so it cannot "
                             f"resume on another number of workers ({world}): {keep}") from None


def _check_model(directory: Path, model: nn.Module, config: TrainConfig, path: Path | None = None,
                 role: str = "") -> None:
    """UsageError when the checkpoint (its model file ``path``, by default rank 0's) is of another
    model than ``model`` (the resume would refuse it too, but only after the files were re-dealt)."""
    optimizer_class, hyper = optimizer_spec(config)
    check_model_file(path or model_file(directory, 0), model_layout(model, optimizer_class, hyper), role)
