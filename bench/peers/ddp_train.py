"""The peer a user would pick: torch DistributedDataParallel, optionally with torch's PowerSGD or fp16 hook.

Same data order, model, initialisation, optimizer and evaluation as `convoy train`,
and the same metrics files, so a benchmark can put both side by side. Run it one
process per rank (torchrun or `convoy bench cluster -- bench/peers/ddp_train.py ...`),
or call ``train_ddp`` from a process that already joined a gloo group.

``--no-exchange`` runs the same ranks with no exchange at all (each trains its
own replica on its share of the batch): its step is the compute floor that
every strategy's step is read against.

``--checkpoint-dir D --checkpoint-every C`` saves the model, optimizer and
scheduler with torch.distributed.checkpoint (``dcp.save``, every rank, one
folder ``D/step-N`` per checkpoint) every C steps, and a start resumes from the
newest complete one: what a DDP job restarted by ``torchrun --max-restarts``
does. The comm hook's own state (PowerSGD's error feedback and warm start)
is not in it, as torch keeps it outside the model and optimizer: a resumed
PowerSGD job starts its compression afresh.
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from convoy.data import GlobalBatchSampler, build_dataset, iterate_batches  # noqa: E402
from convoy.models import build_model  # noqa: E402
from convoy.sync import ring_allreduce_bytes  # noqa: E402
from convoy.train.metrics import MetricsWriter  # noqa: E402
from convoy.train.optim import lr_lambda  # noqa: E402
from convoy.parallel.scoring import score  # noqa: E402

KEEP_CHECKPOINTS = 2   # the newest and one before it, in case the newest is cut short by a failure


class _CountedAllReduce:
    """Counts the bytes of PowerSGD's all-reduces (Python calls) as ring all-reduces, like convoy's."""

    def __init__(self, world: int):
        self.world, self.sent, self._original = world, 0, dist.all_reduce

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")   # a comm hook's or averager's subgroup
        world = dist.get_world_size(group) if group is not None else self.world
        self.sent += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world)
        return self._original(tensor, *args, **kwargs)

    def __enter__(self) -> "_CountedAllReduce":
        dist.all_reduce = self
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def train_ddp(rank: int, world: int, *, steps: int, model: str = "lenet", dataset: str = "digits",
              batch_size: int = 32, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 5e-4,
              lr_schedule: str = "cosine", eval_every: int = 0, seed: int = 0, powersgd_rank: int = 0,
              powersgd_start: int = 2, stop_at_accuracy: float | None = None, out: str | None = None,
              setup: Callable[[DistributedDataParallel, torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
              fp16_hook: bool = False, no_exchange: bool = False, checkpoint_dir: str | None = None,
              checkpoint_every: int = 0) -> dict:
    """Train with DDP (+ PowerSGD when ``powersgd_rank`` > 0, + fp16 compression when ``fp16_hook``);
    return accuracy, wall time, bytes per step. ``no_exchange``: no DDP, each rank trains alone.

    ``setup(net, optimizer)`` may register a comm hook and return a wrapping
    optimizer (torch's local SGD / model averaging: bench/peers/hier_sgd.py);
    its Python all-reduces are then what is counted. ``checkpoint_dir``: resume from its newest
    DCP checkpoint, and save one every ``checkpoint_every`` steps (0: never).
    """
    data = build_dataset(dataset)
    torch.manual_seed(seed)
    # With gloo, torch's PowerSGD hook chains its all-reduces in callbacks that
    # race across buckets: with two or more buckets the ranks' collectives can
    # come in different orders and gloo aborts ("Received data size doesn't
    # match expected size"). One bucket keeps its order fixed.
    buckets = {"bucket_cap_mb": 4096} if powersgd_rank else {}
    local = build_model(model, in_channels=data.in_channels, num_classes=data.num_classes,
                        image_size=data.image_size)
    net = local if no_exchange else DistributedDataParallel(local, **buckets)
    if powersgd_rank:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=max(powersgd_start, 2))
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif fp16_hook:
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    dense = 0 if no_exchange else ring_allreduce_bytes(size // 2 if fp16_hook else size, world)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    counted = bool(powersgd_rank or setup)   # else DDP's own (C++) all-reduce: the dense bytes
    if setup is not None:
        opt = setup(net, opt)
    factor = lr_lambda(lr_schedule, steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor) if factor else None
    sampler = GlobalBatchSampler(len(data.train), batch_size, world, rank, seed)
    step = resume(Path(checkpoint_dir), local, opt, sched) if checkpoint_dir else 0
    # The data order goes on where the checkpoint left it: the epoch, and the batches of it already trained.
    epoch, skip = divmod(step, len(sampler))
    metrics = MetricsWriter(Path(out), rank) if out else None
    start, done, accuracy = time.perf_counter(), False, 0.0
    last = start
    with _CountedAllReduce(world) as counter:
        while step < steps and not done:
            sampler.set_epoch(epoch)
            for x, y in iterate_batches(data.train, islice(sampler, skip, None)):
                sent_before = counter.sent
                opt.zero_grad()
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                if sched:
                    sched.step()
                now = time.perf_counter()
                sent = counter.sent - sent_before if counted else dense
                if metrics:
                    metrics.write("step", step=step, epoch=epoch, loss=loss.item(), time=now - start,
                                  wall_s=now - last, wait_s=0.0, compute_s=now - last, bytes_sent=sent,
                                  bytes_received=sent)
                last, step = now, step + 1
                if checkpoint_dir and checkpoint_every and step % checkpoint_every == 0 and step < steps:
                    save_checkpoint(Path(checkpoint_dir), step, local, opt, sched)
                    last = time.perf_counter()   # the save is the job's time, not the next step's
                if (eval_every and step % eval_every == 0) or step == steps:
                    accuracy, test_loss = score(local.eval(), data.test, torch.device("cpu"))
                    net.train()
                    if metrics:
                        metrics.write("eval", step=step, time=time.perf_counter() - start,
                                      test_accuracy=accuracy, test_loss=test_loss)
                    last = time.perf_counter()
                    done = stop_at_accuracy is not None and accuracy >= stop_at_accuracy
                if step >= steps or done:
                    break
            epoch, skip = epoch + 1, 0
    wall = time.perf_counter() - start
    if metrics:
        metrics.close()
    total = counter.sent if counted else dense * step
    # DDP's reducer sits in a reference cycle; if it outlives the process group
    # (destroyed by the caller), the process aborts at exit.
    dist.barrier()
    del net, opt, sched
    gc.collect()
    return {"test_accuracy": accuracy, "wall_s": wall, "bytes_per_step": total / step}


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state, "sched": sched.state_dict() if sched else {}, "step": step}


def save_checkpoint(directory: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    sched: Any) -> None:
    """``dcp.save`` of the training state after ``step`` steps into ``directory/step-<step>`` (every rank
    calls it; DCP writes ``.metadata`` last, so a folder without it is an interrupted save); then
    rank 0 drops all but the newest :data:`KEEP_CHECKPOINTS`."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt, sched, step), checkpoint_id=str(directory / f"step-{step}"))
    if dist.get_rank() == 0:
        for old in complete_checkpoints(directory)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(directory: Path) -> list[Path]:
    """The folders of ``directory`` that hold a complete DCP checkpoint, oldest first."""
    found = [path for path in directory.glob("step-*") if (path / ".metadata").exists()]
    return sorted(found, key=lambda path: int(path.name.split("-")[1]))


def resume(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> int:
    """Load the newest complete checkpoint of ``directory`` into the model, optimizer and scheduler;
    the step it was taken after (0, changing nothing, when there is none)."""
    import torch.distributed.checkpoint as dcp

    saved = complete_checkpoints(directory) if directory.is_dir() else []
    if not saved:
        return 0
    state = _state(model, opt, sched, 0)
    dcp.load(state, checkpoint_id=str(saved[-1]))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if sched:
        sched.load_state_dict(state["sched"])
    if dist.get_rank() == 0:
        print(f"ddp_train: resumed from {saved[-1]} at step {state['step']}", file=sys.stderr, flush=True)
    return state["step"]


def arguments(description: str | None = __doc__) -> argparse.ArgumentParser:
    """The peer's command line (shared with the other torch peers)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="lenet")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--lr-schedule", default="cosine")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-accuracy", type=float, default=None)
    p.add_argument("--powersgd-rank", type=int, default=0, help="PowerSGD matrix rank (0: plain DDP)")
    p.add_argument("--powersgd-start", type=int, default=2, help="dense steps before PowerSGD starts (at "
                   "least 2, torch's minimum)")
    p.add_argument("--fp16-hook", action="store_true", help="DDP's fp16_compress_hook")
    p.add_argument("--no-exchange", action="store_true", help="no DDP: every rank trains alone (the compute "
                   "floor of the same ranks)")
    p.add_argument("--checkpoint-dir", default=None, help="resume from the newest DCP checkpoint here, and save "
                   "into it")
    p.add_argument("--checkpoint-every", type=int, default=0, help="a DCP checkpoint every N steps (0: none)")
    p.add_argument("--out", required=True)
    return p


def run_peer(args: argparse.Namespace, **extra: Any) -> None:
    """Join the job's gloo group from torchrun's variables, train, leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_ddp(dist.get_rank(), dist.get_world_size(), **vars(args), **extra)
    dist.destroy_process_group()


def main() -> None:
    run_peer(arguments().parse_args())


if __name__ == "__main__":
    main()
