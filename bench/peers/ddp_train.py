"""The peer a user would pick: torch DistributedDataParallel, optionally with torch's PowerSGD hook.

Same data order, model, initialisation, optimizer and evaluation as `convoy train`,
and the same metrics files, so a benchmark can put both side by side. Run it one
process per rank (torchrun or `convoy bench cluster -- bench/peers/ddp_train.py ...`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from convoy.data import GlobalBatchSampler, build_dataset, iterate_batches  # noqa: E402
from convoy.models import build_model  # noqa: E402
from convoy.train.scoring import score  # noqa: E402
from convoy.train.metrics import MetricsWriter  # noqa: E402
from convoy.train.optim import lr_lambda  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
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
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = build_dataset(args.dataset)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model, in_channels=data.in_channels,
                                                num_classes=data.num_classes, image_size=data.image_size))
    if args.powersgd_rank:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    factor = lr_lambda(args.lr_schedule, args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor) if factor else None
    sampler = GlobalBatchSampler(len(data.train), args.batch_size, world, rank, args.seed)
    metrics = MetricsWriter(Path(args.out), rank)
    start, step, epoch, last, done = time.perf_counter(), 0, 0, time.perf_counter(), False
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in iterate_batches(data.train, sampler):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            now = time.perf_counter()
            metrics.write("step", step=step, epoch=epoch, loss=loss.item(), time=now - start, wall_s=now - last,
                          wait_s=0.0, compute_s=now - last, bytes_sent=0, bytes_received=0)
            last, step = now, step + 1
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                model.eval()
                with torch.no_grad():
                    accuracy, test_loss = score(model.module, data.test, torch.device("cpu"))
                model.train()
                metrics.write("eval", step=step, time=time.perf_counter() - start,
                              test_accuracy=accuracy, test_loss=test_loss)
                last = time.perf_counter()
                done = args.stop_at_accuracy is not None and accuracy >= args.stop_at_accuracy
            if step >= args.steps or done:
                break
        if done:
            break
        epoch += 1
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
