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

import dataclasses
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

from convoy import runtime
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.listener import model_file
from convoy.checkpoint.reshard import STAGING, cleanup, complete, rank_files, recorded_job, reshard
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
    if ctx.rank == 0:
        try:
            outcome = [_adapt(config, model, ctx.world_size)]
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
    return dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))


def finish_resharding(config: TrainConfig, rank: int) -> None:
    """After the run's last commit (rank 0): drop the old world's rank files a re-deal kept aside,
    if every rank file has committed a step of the new world (else the next start does)."""
    if config.checkpoint.dir is not None and rank == 0 and Path(config.checkpoint.dir).is_dir():
        cleanup(Path(config.checkpoint.dir))


def _adapt(config: TrainConfig, model: nn.Module, world: int) -> tuple[str, object] | None:
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
    if job is None or job.world == world:
        return None
    accum = config.optim.grad_accum
    global_batch = job.global_batch or config.data.batch_size * accum * job.world
    keep = f"run on {job.world} workers, or pass --no-resume to start over"
    if config.sync.strategy != "allreduce" or config.parallel.layout != "data" or job.model_files != 1:
        raise UsageError(f"--checkpoint-dir {directory} holds a checkpoint of {job.world} workers; only "
                         f"--sync allreduce with --parallel data resumes on another number ({world}): {keep}")
    if global_batch % (world * accum):
        per = f" x --grad-accum {accum}" if accum > 1 else ""
        raise UsageError(f"--checkpoint-dir {directory}: the checkpoint's global batch of {global_batch} does not "
                         f"divide over {world} workers{per}; {keep}")
    _check_model(directory, model, config)
    deal = reshard(directory, job.world, world)
    batch = global_batch // (world * accum)
    note = (f"convoy: checkpoint: {directory} was written by {job.world} workers; resuming on {world}: global batch "
            f"{global_batch} kept ({batch} per worker{' per micro-batch' if accum > 1 else ''}), per-rank state "
            f"re-dealt at step {deal.step}")
    if deal.retrained:
        note += (f" (the newest step every rank file holds: the {deal.retrained} logged steps after it are "
                 "trained again)")
    if deal.inexact:
        note += (f"; {deal.inexact} residual values kept their mean only to float32 precision "
                 "(their values span too wide a range to be dealt exactly)")
    return "resharded", (batch, note)


def _check_model(directory: Path, model: nn.Module, config: TrainConfig) -> None:
    """UsageError when the checkpoint is of another model (the resume would refuse it too,
    but only after the rank files were re-dealt)."""
    optimizer_class, hyper = optimizer_spec(config)
    layout = model_layout(model, optimizer_class, hyper)
    path = model_file(directory, 0)
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
