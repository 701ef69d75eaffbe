"""One training job from a TrainConfig: the code behind ``convoy train``."""
from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from convoy import runtime
from convoy.checkpoint.export import load_initial_state
from convoy.checkpoint.session import (CheckpointSession, CheckpointSettings, ResumePoint, check_directory,
                                      start_checkpointing)
from convoy.data import DatasetSplits, GlobalBatchSampler, build_dataset, iterate_batches
from convoy.engine import Engine
from convoy.engine.gradients import GradientGate, LossScaler
from convoy.errors import JobStopped, TrainingDiverged, UsageError
from convoy.models import build_model
from convoy.utils.atomic import save_atomically
from convoy.parallel import ParallelLayout
from convoy.parallel.groups import ProcessGroups
from convoy.parallel.shape import JobShape
from convoy.sync import SyncStrategy, ring_allreduce_bytes
from convoy.train.config import TrainConfig, save_config
from convoy.train.elastic import adapt_to_checkpoint, finish_resharding, job_record
from convoy.train.divergence import DivergenceGuard, StopAgreement, divergence_hint
from convoy.train.metrics import MetricsWriter
from convoy.train.groups import job_groups
from convoy.train.optim import build_compression, lr_lambda, optimizer_spec
from convoy.utils.lifetime import StopRequest
from convoy.utils.timeline import mark

@dataclass
class RunSummary:
    steps: int
    wall_s: float
    test_accuracy: float
    test_loss: float
    bytes_sent_per_worker: float   # the mean over all ranks
    run_dir: str
    bytes_sent_rank0: float | None = None   # what the progress bar counts; differs in ps and hybrid jobs
    stopped: StopAgreement | None = None   # a stop signal ended the run after ``steps`` steps

    def line(self) -> str:
        sent, rank0 = f"{self.bytes_sent_per_worker / 1e6:.2f}", f"{(self.bytes_sent_rank0 or 0) / 1e6:.2f}"
        shown = self.bytes_sent_rank0 is not None and rank0 != sent   # ranks sent unequal amounts
        mine = f" (rank 0: {rank0} MB, as on the progress bar)" if shown else ""
        return (f"convoy: {self.steps} steps in {self.wall_s:.1f} s, test accuracy "
                f"{100 * self.test_accuracy:.2f}%, {sent} MB sent per worker on average{mine}; "
                f"run folder {self.run_dir}")


def run(config: TrainConfig, stop: StopRequest | None = None) -> RunSummary:
    """Train as ``config`` says, on the process group from the environment.

    Args:
        config: the job's settings.
        stop: the worker's stop request (its signal handler); when a rank
            receives a stop signal, every rank finishes the same step, commits a
            checkpoint there (with --checkpoint-dir) and raises :class:`JobStopped`.
    """
    stop = stop or StopRequest()
    if config.checkpoint.dir is not None:   # created before anything reads it (a resharding, a cluster plan)
        check_directory(config.checkpoint.dir)
    ctx = runtime.init("nccl" if config.run.device == "cuda" else "gloo", timeout_s=config.run.timeout)
    mark("process group")
    torch.set_num_threads(config.run.threads)
    splits = build_dataset(config.data.dataset, config.data.dir,
                           synthetic_shape=config.data.synthetic_dims(), seed=config.run.seed)
    mark("dataset loaded")
    torch.manual_seed(config.run.seed)
    model = build_model(config.model.name, in_channels=splits.in_channels, num_classes=splits.num_classes,
                        image_size=splits.image_size).to(ctx.device)
    if config.checkpoint.init_from is not None:
        load_initial_state(model, config.checkpoint.init_from)
    # A data-parallel engine trains the model's own tensors: their broadcast can wait until the resume
    # is known, and a resume needs none (every rank loads the same checkpointed model): seconds of a
    # failure's downtime on a slow link. Other layouts copy parameters as they are built.
    deferred = config.checkpoint.dir is not None and (config.sync.strategy, config.parallel.layout) == \
        ("allreduce", "data")
    if not deferred:
        broadcast_parameters(model)
    mark("model built")
    # A checkpoint of another number of workers: its global batch is kept, its rank files re-dealt.
    config = adapt_to_checkpoint(config, model, ctx)
    mark("checkpoint mapped")   # re-dealt onto this world, if it was another's
    shape = config.job_shape(ctx.world_size)
    groups = job_groups(config, shape)   # every process group of the job, in one order on every rank
    # A step's samples per worker: --grad-accum micro-batches of --batch-size.
    step_batch = config.data.batch_size * config.optim.grad_accum
    steps_per_epoch = len(GlobalBatchSampler(len(splits.train), step_batch, shape.data_world_size, 0, config.run.seed))
    total_steps = config.run.total_steps(steps_per_epoch)
    layout = build_layout(config, model, ctx, total_steps, (splits.in_channels, *splits.image_size), shape, groups)
    sampler = GlobalBatchSampler(len(splits.train), step_batch, layout.data_world_size, layout.data_rank,
                                 config.run.seed)
    session = start_checkpoints(config, layout, total_steps, len(sampler), groups)
    if deferred and not (session.start.step or session.start.replay_to):
        broadcast_parameters(model)   # nothing was restored: every rank starts from rank 0's
    mark("checkpoint restored")
    run_dir = resolve_run_dir(config.run.out, ctx.rank)
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir)
    metrics = MetricsWriter(run_dir, ctx.rank, config.run.logger)
    guard = DivergenceGuard(groups.bookkeeping,
                            divergence_hint(config.optim.lr, config.optim.amp, config.optim.clip_grad_norm))
    try:
        summary = _train(config, ctx, layout, splits, sampler, total_steps, metrics, run_dir,
                         guard, session.start if session else ResumePoint(), stop)
    except TrainingDiverged as exc:   # the engine's or the guard's message, with what to try
        raise guard.explain(exc) from None
    except Exception as exc:
        explained = layout.engine.explain_failure(exc)
        if explained is exc:
            raise
        raise explained from exc
    finally:
        metrics.close()
    layout.engine.close()
    if summary.stopped is not None:
        _commit_and_stop(summary, session)
    if session is not None:
        session.listener.close()   # the last checkpoint is committed before the job ends
        finish_resharding(config, ctx.rank)
    if config.sync.trace:
        layout.save_trace(run_dir)
    state = layout.full_state_dict()   # a collective: every rank's trace file is written after it
    if config.sync.trace and ctx.rank == 0:
        from convoy.ps.chrome_trace import merge_traces

        merge_traces(run_dir)
    if ctx.rank == 0:
        save_atomically({"model": state, "optimizers": layout.engine.optimizer_state()},
                        run_dir / "model.pt")
        (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def _commit_and_stop(summary: RunSummary, session: CheckpointSession | None) -> None:
    """Commit a checkpoint of the last step every rank finished, wait for every rank, raise JobStopped."""
    stopped = summary.stopped
    if session is not None:
        if summary.steps > session.start.reached:   # else the resumed checkpoint holds that step
            session.listener.commit_now(summary.steps - 1)
        session.listener.close()
    if dist.is_initialized():
        dist.barrier()   # every rank's files are committed before any rank reports the stop
    raise JobStopped(stopped.signum, stopped.who(), summary.steps,
                     summary.steps if session is not None else None)


def start_checkpoints(config: TrainConfig, layout: ParallelLayout, total_steps: int,
                      steps_per_epoch: int, groups: ProcessGroups) -> CheckpointSession | None:
    """Resume from ``--checkpoint-dir`` if it holds a checkpoint, and checkpoint from now on
    (``groups``: the job's, whose ``agree_every`` and ``agree_full`` settle "auto" intervals)."""
    if config.checkpoint.dir is None:
        return None
    optimizer_class, hyper = optimizer_spec(config)
    every = config.checkpoint.every
    if every != "auto":
        every = layout.engine.sync.checkpoint_period(every)   # hierarchical: whole cycles
    elif layout.engine.sync.checkpoint_period(1) != 1:
        raise UsageError("--checkpoint-every auto cannot be used with --sync hierarchical: its checkpoints fall "
                         f"on exchange steps; give a multiple of --exchange-every ({config.sync.exchange_every})")
    job = job_record(config, dist.get_world_size() if dist.is_initialized() else 1,
                     config.data.batch_size * config.optim.grad_accum * layout.data_world_size)
    settings = CheckpointSettings(config.checkpoint.dir, every, config.checkpoint.resume, config.run.timeout,
                                  config.checkpoint.budget, config.checkpoint.full_every, job,
                                  config.checkpoint.rank_files)
    module, group_ranks, full_names = layout.checkpoint_scope()
    return start_checkpointing(settings, module, layout.checkpoint_engine(), optimizer_class, hyper, total_steps,
                               steps_per_epoch, group_ranks, full_names, (groups.agree_every, groups.agree_full))


def build_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int,
                 input_shape: tuple[int, ...], shape: JobShape | None = None,
                 groups: ProcessGroups | None = None) -> ParallelLayout:
    """This rank's parallel layout, with an engine (sync strategy, compressor) for its part of the model.

    ``shape`` and ``groups``: the job's, as :func:`run` made them (default: made here, on every rank).
    """
    shape = shape or config.job_shape(ctx.world_size)
    groups = groups if groups is not None else job_groups(config, shape)
    scaler = LossScaler() if config.optim.amp == "fp16" else None
    strategy, layout = config.strategy_spec(), config.layout_spec()
    if strategy.layouts is not None:   # the strategy lays out the job itself (ps: servers and workers)
        return strategy.layouts[layout.name](config, model, ctx, total_steps, input_shape, groups, scaler)
    optimizer_class, hyper = optimizer_spec(config)
    # Every rank makes the strategy's engines alike, after the job's groups (hierarchical: plans its clusters).
    make_sync = strategy.syncs(config, ctx, shape, total_steps)
    gate_group = groups.whole_step

    def make_engine(part: nn.Module, group: dist.ProcessGroup | None) -> Engine:
        workers = dist.get_world_size(group) if group is not None else ctx.world_size
        compressor, memory = build_compression(config, workers)
        sync: SyncStrategy = make_sync(group, compressor, memory)
        # Hybrid: every rank of ``group`` holds the same averaged gradient of ``part``; each adds 1/workers of it.
        gate = GradientGate(config.optim.clip_grad_norm, scaler, gate_group, 1.0 / workers)
        return Engine(part, optimizer_class, sync, listeners=sync.listeners(),
                      lr_lambda=lr_lambda(config.optim.lr_schedule, total_steps), gate=gate, **hyper)

    return layout.build(config, model, ctx, input_shape, shape, groups, scaler, make_engine)


def _train(config: TrainConfig, ctx: runtime.Context, layout: ParallelLayout, splits: DatasetSplits,
           sampler: GlobalBatchSampler, total_steps: int, metrics: MetricsWriter, run_dir: Path,
           guard: DivergenceGuard, resume: ResumePoint, stop: StopRequest) -> RunSummary:
    engine = layout.engine
    bar = tqdm(total=total_steps, initial=resume.step, disable=not (config.run.progress and ctx.rank == 0),
               unit="step", dynamic_ncols=True, leave=False)
    start = time.perf_counter()
    bytes_sent, step, epoch, last = 0, resume.step, resume.epoch, None
    skip = resume.position   # batches of the resumed epoch already trained
    accuracy, seen, right, stopped = None, 0, 0, None
    stop.defer()   # from here a stop signal ends the run after a step every rank agrees on
    while step < total_steps and stopped is None:
        sampler.set_epoch(epoch)
        for x, y in iterate_batches(splits.train, islice(sampler, skip, None)):
            loss, correct = layout.train_step(x.to(ctx.device), y.to(ctx.device))
            if step == resume.step:
                mark("first step")
            stopped = guard.check(step, loss, stop.signum)
            if last is not None:
                bytes_sent += _record_step(metrics, layout, *last)
            last = (step, epoch, loss, correct / len(y), time.perf_counter() - start)
            step += 1
            samples_per_s = (step - resume.step) * len(y) * layout.data_world_size / (time.perf_counter() - start)
            if config.run.eval_every and step % config.run.eval_every == 0 and step < total_steps:
                accuracy, test_loss = layout.evaluate(splits.test, ctx.device)
                metrics.write("eval", step=step, time=time.perf_counter() - start,
                              test_accuracy=accuracy, test_loss=test_loss)
            seen, right = seen + len(y), right + correct
            shown = {"test_acc": f"{accuracy:.3f}"} if accuracy is not None else {"train_acc": f"{right / seen:.3f}"}
            bar.set_postfix(loss=f"{loss:.3f}", **shown, samples_s=f"{samples_per_s:.0f}",
                            rank0_sent=f"{bytes_sent / 1e6:.1f}MB", refresh=False)
            bar.update()
            if step >= total_steps or _reached(config, accuracy) or stopped is not None:
                break
        if _reached(config, accuracy):
            break
        epoch, skip = epoch + 1, 0
    stopped = stopped or guard.finish()
    if step >= total_steps or _reached(config, accuracy):   # the signal came too late: the run is complete
        stopped = None
    engine.synchronize()
    if last is not None:   # None when resuming a finished run
        bytes_sent += _record_step(metrics, layout, *last)
    if stopped is not None:   # no evaluation: the stop should be quick
        bar.close()
        return RunSummary(step, time.perf_counter() - start, float("nan"), float("nan"), bytes_sent, str(run_dir),
                          stopped=stopped)
    wall = time.perf_counter() - start
    accuracy, test_loss = layout.evaluate(splits.test, ctx.device)
    metrics.write("eval", step=step, time=wall, test_accuracy=accuracy, test_loss=test_loss)
    bar.close()
    return RunSummary(step, wall, accuracy, test_loss, _mean_over_ranks(bytes_sent), str(run_dir),
                      bytes_sent_rank0=bytes_sent if ctx.rank == 0 else None)


def _reached(config: TrainConfig, accuracy: float | None) -> bool:
    # Every rank sees the same all-reduced accuracy, so all stop at the same step.
    return config.run.stop_at_accuracy is not None and accuracy is not None and accuracy >= config.run.stop_at_accuracy


def _record_step(metrics: MetricsWriter, layout: ParallelLayout, step: int, epoch: int, loss: float,
                 train_accuracy: float, elapsed: float) -> int:
    stats = layout.engine.stats(step)
    # The engine's group: all ranks in data parallelism, one role's ring in hybrid.
    dense = dense_step_bytes(layout.engine, layout.engine.sync.world_size)
    # ru_maxrss is in KiB on Linux: the process's peak resident memory so far.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    own = layout.step_metrics(step)
    metrics.write("step", epoch=epoch, loss=loss, train_accuracy=train_accuracy, time=elapsed,
                  compression_ratio=dense / stats.bytes_sent if stats.bytes_sent else 1.0, **stats.as_dict(),
                  peak_rss_mb=peak_rss_mb, **own, **layout.engine.sync.step_metrics(step),
                  **(layout.engine.gate.step_metrics(step) if layout.engine.gate is not None else {}))
    # The rank's link also carries what the layout sends beside its engine (hybrid's link, a colocated server).
    return stats.bytes_sent + sum(value for key, value in own.items() if key.endswith("_bytes_sent"))


def dense_step_bytes(engine: Engine, world_size: int) -> int:
    """Bytes a worker would send in one step of uncompressed fp32 ring all-reduces of every bucket."""
    return sum(ring_allreduce_bytes(sum(layer.nbytes for layer in bucket.layers), world_size)
               for bucket in engine.buckets)


def broadcast_parameters(model: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if dist.is_initialized():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


def _mean_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def resolve_run_dir(out: str | None, rank: int) -> Path:
    """``out``, or runs/<time> chosen by rank 0 so every rank agrees."""
    if out is not None:
        return Path(out)
    name = [time.strftime("runs/%Y%m%d-%H%M%S") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])
