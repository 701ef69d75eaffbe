"""One training job from a TrainConfig: the code behind ``convoy train``."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from convoy import runtime
from convoy.compress import build_compressor
from convoy.data import DatasetSplits, GlobalBatchSampler, build_dataset, iterate_batches, shard_indices
from convoy.engine import Engine
from convoy.models import build_model
from convoy.parallel import DataParallel, ParallelLayout
from convoy.sync import AllReduce
from convoy.train.config import TrainConfig, save_config
from convoy.train.metrics import MetricsWriter
from convoy.train.optim import lr_lambda, resolve_optimizer, supported_kwargs

_EVAL_CHUNK = 512


@dataclass
class RunSummary:
    steps: int
    wall_s: float
    test_accuracy: float
    test_loss: float
    bytes_sent_per_worker: float
    run_dir: str

    def line(self) -> str:
        return (f"convoy: {self.steps} steps in {self.wall_s:.1f} s, test accuracy "
                f"{100 * self.test_accuracy:.2f}%, {self.bytes_sent_per_worker / 1e6:.2f} MB sent "
                f"per worker; run folder {self.run_dir}")


def run(config: TrainConfig) -> RunSummary:
    """Train as ``config`` says, on the process group from the environment."""
    ctx = runtime.init(timeout_s=config.timeout)
    torch.set_num_threads(config.threads)
    splits = build_dataset(config.dataset, config.data_dir,
                           synthetic_shape=config.synthetic_dims(), seed=config.seed)
    torch.manual_seed(config.seed)
    model = build_model(config.model, in_channels=splits.in_channels, num_classes=splits.num_classes,
                        image_size=splits.image_size).to(ctx.device)
    broadcast_parameters(model)
    sampler = GlobalBatchSampler(len(splits.train), config.batch_size, ctx.world_size, ctx.rank, config.seed)
    total_steps = config.total_steps(len(sampler))
    layout = build_layout(config, model, ctx, total_steps)
    run_dir = resolve_run_dir(config.out, ctx.rank)
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir)
    metrics = MetricsWriter(run_dir, ctx.rank)
    try:
        summary = _train(config, ctx, layout, splits, sampler, total_steps, metrics, run_dir)
    finally:
        metrics.close()
    layout.engine.close()
    if ctx.rank == 0:
        torch.save({"model": model.state_dict(), "optimizers": layout.engine.optimizer_state()},
                   run_dir / "model.pt")
        (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def build_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int) -> ParallelLayout:
    """The engine with its sync strategy and compressor, inside the parallel layout."""
    optimizer_class = resolve_optimizer(config.optimizer)
    hyper = supported_kwargs(optimizer_class, lr=config.lr, momentum=config.momentum,
                             weight_decay=config.weight_decay)
    compressor, memory = build_compressor(config.compress)
    # A group of its own keeps the engine's collectives from interleaving with
    # the training loop's (evaluation, bookkeeping) on the default group.
    group = dist.new_group() if ctx.world_size > 1 else None
    engine = Engine(model, optimizer_class, AllReduce(group, compressor, memory),
                    lr_lambda=lr_lambda(config.lr_schedule, total_steps), **hyper)
    return DataParallel(model, engine, ctx.rank, ctx.world_size)


def _train(config: TrainConfig, ctx: runtime.Context, layout: ParallelLayout, splits: DatasetSplits,
           sampler: GlobalBatchSampler, total_steps: int, metrics: MetricsWriter, run_dir: Path) -> RunSummary:
    engine = layout.engine
    bar = tqdm(total=total_steps, disable=not (config.progress and ctx.rank == 0), unit="step",
               dynamic_ncols=True, leave=False)
    start = time.perf_counter()
    bytes_sent, step, epoch, last = 0, 0, 0, None
    accuracy, seen, right = None, 0, 0
    while step < total_steps:
        sampler.set_epoch(epoch)
        for x, y in iterate_batches(splits.train, sampler):
            loss, correct = layout.train_step(x.to(ctx.device), y.to(ctx.device))
            if last is not None:
                bytes_sent += _record_step(metrics, engine, *last)
            last = (step, epoch, loss, correct / len(y), time.perf_counter() - start)
            step += 1
            samples_per_s = step * len(y) * layout.data_world_size / (time.perf_counter() - start)
            if config.eval_every and step % config.eval_every == 0 and step < total_steps:
                accuracy, test_loss = evaluate(layout, splits.test, ctx.device)
                metrics.write("eval", step=step, time=time.perf_counter() - start,
                              test_accuracy=accuracy, test_loss=test_loss)
            seen, right = seen + len(y), right + correct
            shown = {"test_acc": f"{accuracy:.3f}"} if accuracy is not None else {"train_acc": f"{right / seen:.3f}"}
            bar.set_postfix(loss=f"{loss:.3f}", **shown, samples_s=f"{samples_per_s:.0f}",
                            sent=f"{bytes_sent / 1e6:.1f}MB", refresh=False)
            bar.update()
            if step >= total_steps or _reached(config, accuracy):
                break
        if _reached(config, accuracy):
            break
        epoch += 1
    engine.synchronize()
    bytes_sent += _record_step(metrics, engine, *last)
    wall = time.perf_counter() - start
    accuracy, test_loss = evaluate(layout, splits.test, ctx.device)
    metrics.write("eval", step=step, time=wall, test_accuracy=accuracy, test_loss=test_loss)
    bar.close()
    return RunSummary(step, wall, accuracy, test_loss, _mean_over_ranks(bytes_sent), str(run_dir))


def _reached(config: TrainConfig, accuracy: float | None) -> bool:
    # Every rank sees the same all-reduced accuracy, so all stop at the same step.
    return config.stop_at_accuracy is not None and accuracy is not None and accuracy >= config.stop_at_accuracy


def _record_step(metrics: MetricsWriter, engine: Engine, step: int, epoch: int, loss: float,
                 train_accuracy: float, elapsed: float) -> int:
    stats = engine.stats(step)
    metrics.write("step", epoch=epoch, loss=loss, train_accuracy=train_accuracy, time=elapsed,
                  **stats.as_dict())
    return stats.bytes_sent


def evaluate(layout: ParallelLayout, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
    """Accuracy and mean loss on the test set, each rank scoring a shard of it."""
    layout.engine.synchronize()
    average_buffers(layout.engine.model)
    return score(layout.predict, test, device)


def score(predict: Callable[[torch.Tensor], torch.Tensor], test: torch.utils.data.Dataset,
          device: torch.device) -> tuple[float, float]:
    """Accuracy and mean loss of ``predict`` (inputs -> logits) on ``test``, sharded over ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    shard = shard_indices(len(test), world, rank)
    totals = torch.zeros(3, dtype=torch.float64)
    for begin in range(shard.start, shard.stop, _EVAL_CHUNK):
        xs, ys = zip(*(test[i] for i in range(begin, min(begin + _EVAL_CHUNK, shard.stop))))
        x, y = torch.stack(xs).to(device), torch.as_tensor(ys, dtype=torch.int64).to(device)
        logits = predict(x)
        totals += torch.tensor([(logits.argmax(1) == y).sum().item(),
                                len(y), nn.functional.cross_entropy(logits, y, reduction="sum").item()],
                               dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    correct, count, loss_sum = totals.tolist()
    return correct / count, loss_sum / count


def broadcast_parameters(model: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if dist.is_initialized():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


def average_buffers(model: nn.Module) -> None:
    """Average floating-point buffers (batch-norm statistics) over ranks before evaluation.

    Each rank's running statistics saw only its share of the batches; the
    average is what one process seeing all of them would hold, to first order.
    """
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer.data)
            buffer.data.div_(world)


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
