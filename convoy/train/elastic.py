"""Resuming a checkpoint on another number of workers: keep its global batch, re-deal its per-rank state.

``convoy train`` with another ``--nproc`` (or under torchrun's re-formed world)
on a ``--checkpoint-dir`` that ``N`` workers wrote goes on with ``M``: rank 0
checks that the job can be mapped (``--sync allreduce``, ``--parallel data``,
the checkpoint's global batch divides over ``M``, the same model), re-deals
the rank files (:mod:`convoy.checkpoint.reshard`) and every rank trains on
with ``global batch / M`` samples a step (the data order continues: global
batches do not depend on the world size). Anything else is refused in one
line before a byte of the checkpoint changes.

Example::

    >>> config = adapt_to_checkpoint(config, model, ctx)   # config.data.batch_size: global / M
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

from convoy import runtime
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.files import model_file
from convoy.checkpoint.reshard import STAGING, cleanup, complete, reshard
from convoy.checkpoint.written import rank_files, recorded_job
from convoy.checkpoint.snapshot import model_layout
from convoy.checkpoint.store import Store
from convoy.errors import UsageError
from convoy.train.config import TrainConfig
from convoy.train.optim import optimizer_spec


def adapt_to_checkpoint(config: TrainConfig, model: nn.Module, ctx: runtime.Context) -> TrainConfig:
    """``config`` with the per-worker batch that keeps the checkpoint's global batch on this world,
    after rank 0 re-dealt the checkpoint's per-rank state; ``config`` itself when the world is
    the checkpoint's (or there is none). A collective: every rank calls it.

    Raises:
        UsageError: on every rank, when the checkpoint cannot go on with this world (one line).
    """
    if config.checkpoint.dir is None:
        return config
    outcome: list = [None]
    writers = _node_writers(ctx)
    if ctx.rank == 0:
        try:
            outcome = [_adapt(config, model, ctx.world_size, writers)]
        except UsageError as exc:
            outcome = [("refused", str(exc))]
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


def finish_resharding(config: TrainConfig, rank: int) -> None:
    """After the run's last commit (rank 0): drop the old world's rank files a re-deal kept aside,
    if every rank file has committed a step of the new world (else the next start does)."""
    if config.checkpoint.dir is not None and rank == 0 and Path(config.checkpoint.dir).is_dir():
        cleanup(Path(config.checkpoint.dir))


def _node_writers(ctx: runtime.Context) -> list[int]:
    """The ranks that write a model file in this world: each node's first (local rank 0). A collective."""
    mine = ctx.rank - int(os.environ.get("LOCAL_RANK", ctx.rank))
    if not (dist.is_initialized() and ctx.world_size > 1):
        return [mine]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return sorted(set(everyone))


def _adapt(config: TrainConfig, model: nn.Module, world: int, writers: list[int]) -> tuple[str, object] | None:
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
    elastic = config.sync.strategy == "allreduce" and config.parallel.layout == "data"
    if job.world == world:
        # Only a data-parallel job can have been re-dealt (other layouts' data world is not the world).
        return _same_world(directory, config, global_batch, world, keep) if elastic else None
    if not elastic:
        raise UsageError(f"--checkpoint-dir {directory} holds a checkpoint of {job.world} workers; only "
                         f"--sync allreduce with --parallel data resumes on another number ({world}): {keep}")
    if global_batch % (world * accum):
        per = f" x --grad-accum {accum}" if accum > 1 else ""
        raise UsageError(f"--checkpoint-dir {directory}: the checkpoint's global batch of {global_batch} does not "
                         f"divide over {world} workers{per}; {keep}")
    _check_model(directory, model, config)
    if job.model_files > 1:
        # Several nodes shared the directory (torchrun on several hosts): each node's writer kept a
        # model file; in a data-parallel job they are copies of one model, or this is no such job.
        _check_copies(directory, model, config, world, keep)
    deal = reshard(directory, job.world, world, writers)
    batch = global_batch // (world * accum)
    workers = f"{job.world} worker{'s' if job.world > 1 else ''}"
    note = (f"convoy: checkpoint: {directory} was written by {workers}; resuming on {world}: global batch "
            f"{global_batch} kept ({batch} per worker{' per micro-batch' if accum > 1 else ''}), per-rank state "
            f"re-dealt at step {deal.step}")
    if deal.retrained:
        note += (f" (the newest step every rank file holds: the {deal.retrained} logged steps after it are "
                 "trained again)")
    if deal.inexact:
        note += (f"; {deal.inexact} residual values kept their mean only to float32 precision "
                 "(their values span too wide a range to be dealt exactly)")
    return "resharded", (batch, note)


def _same_world(directory: Path, config: TrainConfig, global_batch: int, world: int,
                keep: str) -> tuple[str, object] | None:
    """None when this world's batch is the checkpoint's; else the per-worker batch that keeps it.

    A job re-dealt onto fewer workers and restarted by torchrun with its first command (the
    original --batch-size) is on the checkpoint's world again, but its global batch must stay
    the one the checkpoint was trained with, or the data order and the trajectory change.
    """
    accum = config.optim.grad_accum
    if global_batch == config.data.batch_size * accum * world:
        return None
    if global_batch % (world * accum):
        raise UsageError(f"--checkpoint-dir {directory}: the checkpoint's global batch of {global_batch} does not "
                         f"divide over {world} workers with --grad-accum {accum}; {keep}")
    batch = global_batch // (world * accum)
    return "kept", (batch, f"convoy: checkpoint: {directory} was trained with a global batch of {global_batch}: "
                           f"kept ({batch} per worker{' per micro-batch' if accum > 1 else ''}, not --batch-size "
                           f"{config.data.batch_size})")


def _check_copies(directory: Path, model: nn.Module, config: TrainConfig, world: int, keep: str) -> None:
    """UsageError unless every model file in ``directory`` holds the whole model (copies kept by
    the nodes of one data-parallel job, not the layer groups of a hybrid or pipeline one)."""
    for path in sorted(directory.glob("model-rank*.ckpt")):
        try:
            _check_model(directory, model, config, path)
        except UsageError:
            raise UsageError(f"--checkpoint-dir {directory}: {path.name} does not hold the whole model (its "
                             f"model files are parts of one, not a data-parallel job's copies), so it cannot "
                             f"resume on another number of workers ({world}): {keep}") from None


def _check_model(directory: Path, model: nn.Module, config: TrainConfig, path: Path | None = None) -> None:
    """UsageError when the checkpoint (its model file ``path``, by default rank 0's) is of another
    model (the resume would refuse it too, but only after the rank files were re-dealt)."""
    optimizer_class, hyper = optimizer_spec(config)
    layout = model_layout(model, optimizer_class, hyper)
    path = path or model_file(directory, 0)
    try:
        store = Store.open(path)
    except (OSError, FormatError) as exc:
        raise UsageError(f"{path} is not a usable checkpoint: {exc}; nothing was changed") from None
    try:
        mismatch = layout.first_mismatch(store.layout)
    finally:
        store.close()
    if mismatch:
        raise UsageError(f"{path} holds a checkpoint of a different model: {mismatch} "
                         "(use another --checkpoint-dir, or --no-resume to overwrite it)")
