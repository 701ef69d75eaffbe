"""Every compressor's exchange on CUDA tensors: the same step as on CPU, replicas alike, and its time.

    python bench/cuda_paths.py [--world 2] [--models resnet18 vgg_fc] [--steps 30] [--check-steps 4]

Needs a CUDA device. One GPU cannot hold two NCCL ranks (NCCL refuses a duplicate GPU), so the ranks
share it over gloo, which carries CUDA tensors through host memory: the figures check that every
compressor's step keeps its tensors where they belong and computes what it does on CPU, not how fast
NCCL is. Per model and compressor (``convoy train --compress``'s names), built by convoy's own
``build_layout`` and stepped by its ``train_step``:

- ``replicas_equal``: after ``--check-steps`` steps on the GPU, every rank's parameters are the
  same bits (data parallelism's promise);
- ``rel_diff_vs_cpu``: ``|gpu - cpu| / |cpu|`` of the parameters after the same steps on CPU
  (float rounding differs between the devices; a misplaced tensor or a wrong sum shows as O(1));
- ``step_ms``: the GPU step, median of ``--steps`` steps (the slowest rank, the exchange drained),
  beside the floor (no exchange) and DDP with torch's PowerSGD hook (rank 4) and fp16 hook on the
  same GPU and gloo.

Writes bench/results/cuda_paths.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save, spawn  # noqa: E402
from bench.figures import Block, number, rows_of, table  # noqa: E402
from convoy import runtime  # noqa: E402
from convoy.compress import compressor_names  # noqa: E402
from convoy.models import build_model  # noqa: E402
from convoy.train.config import TrainConfig  # noqa: E402
from convoy.train.loop import build_layout  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY, BATCH = 0.02, 0.9, 5e-4, 16
PEERS = ("floor", "ddp-powersgd-r4", "ddp-fp16")

Step = Callable[[], None]


def _model(name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, in_channels=_channels(name), num_classes=10).to(device)


def _channels(name: str) -> int:
    return 3 if name == "resnet18" else 1


def _batches(rank: int, name: str, count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(BATCH, _channels(name), 32, 32, generator=g).to(device),
             torch.randint(0, 10, (BATCH,), generator=g).to(device)) for _ in range(count)]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().cpu().flatten() for p in model.parameters()])


def _convoy(name: str, compress: str, rank: int, world: int, device: torch.device):
    config = TrainConfig.from_flat(model=name, compress=compress, lr=LR, momentum=MOMENTUM,
                                   weight_decay=WEIGHT_DECAY, batch_size=BATCH, nproc=world)
    ctx = runtime.Context(rank, world, rank, device, "gloo")
    model = _model(name, device)
    layout = build_layout(config, model, ctx, total_steps=10 ** 6, input_shape=(_channels(name), 32, 32))
    return model, layout


def _peer(name: str, kind: str, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(name, device)
    if kind != "floor":
        # One bucket, as bench/peers/ddp_train.py runs the hooks: with several, the PowerSGD hook's
        # chained all-reduces of two buckets can start in different orders on the ranks over gloo.
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4096)
        if kind == "ddp-fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2, warm_start=True, use_error_feedback=True)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def _timed(step: Step, drain: Step, steps: int) -> float:
    """Median ms of ``steps`` steps, each drained and synchronised, all ranks started together."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(steps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        step()
        drain()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def check_worker(rank: int, world: int, device_name: str, models: list[str], steps: int) -> dict:
    """Every compressor's parameters after ``steps`` steps on ``device_name``."""
    device = torch.device(device_name)
    out = {}
    for name in models:
        batches = _batches(rank, name, steps, device)
        for compress in compressor_names():
            model, layout = _convoy(name, compress, rank, world, device)
            for x, y in batches:
                layout.train_step(x, y)
            layout.engine.synchronize()
            out[(name, compress)] = _flat(model)
            layout.engine.close()
    return out


def time_worker(rank: int, world: int, device_name: str, models: list[str], steps: int) -> dict:
    """Step ms on ``device_name`` of every compressor and of the peers."""
    device = torch.device(device_name)
    out = {}
    for name in models:
        (x, y), = _batches(rank, name, 1, device)
        for kind in PEERS:
            model, opt = _peer(name, kind, device)

            def step() -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            for _ in range(3):
                step()
            out[(name, kind)] = _timed(step, lambda: None, steps)
        for compress in compressor_names():
            _, layout = _convoy(name, compress, rank, world, device)
            for _ in range(3):
                layout.train_step(x, y)
            out[(name, compress)] = _timed(lambda: layout.train_step(x, y), layout.engine.synchronize, steps)
            layout.engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks sharing the GPU over gloo")
    parser.add_argument("--models", nargs="+", default=["resnet18", "vgg_fc"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--check-steps", type=int, default=4, help="steps before the CPU/GPU comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_paths.py: torch sees no CUDA device here")
    gpu = spawn(check_worker, args.world, "cuda", args.models, args.check_steps)
    cpu = spawn(check_worker, args.world, "cpu", args.models, args.check_steps)
    times = spawn(time_worker, args.world, "cuda", args.models, args.steps)
    rows = []
    for name in args.models:
        for kind in (*PEERS, *compressor_names()):
            row = {"model": name, "variant": kind, "step_ms": max(t[(name, kind)] for t in times)}
            if kind not in PEERS:
                ranks = [g[(name, kind)] for g in gpu]
                reference = cpu[0][(name, kind)]
                row["replicas_equal"] = all(torch.equal(ranks[0], r) for r in ranks[1:])
                row["rel_diff_vs_cpu"] = float((ranks[0] - reference).norm() / reference.norm())
            rows.append(row)
        floor = rows[-len(PEERS) - len(compressor_names())]["step_ms"]
        for row in rows[-len(PEERS) - len(compressor_names()):]:
            row["step/floor"] = row["step_ms"] / floor
    settings = {**vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "backend": "gloo (CUDA tensors)", "batch": BATCH}
    save("cuda_paths", settings, rows, ["model", "variant", "step_ms", "step/floor", "replicas_equal",
                                        "rel_diff_vs_cpu"])


def render_cuda_paths() -> str:
    return table(["model", "variant", "GPU step ms", "x floor", "replicas bit-equal", "relative difference to CPU"],
                 [[r["model"], r["variant"], number(r["step_ms"]), number(r["step/floor"]),
                   str(r.get("replicas_equal", "")), number(r.get("rel_diff_vs_cpu"))] for r in rows_of("cuda_paths")])


BLOCKS = (
    Block("cuda_paths", "Every compressor on CUDA tensors (two ranks sharing one H100 over gloo)", ("cuda_paths",),
          "DDP with torch's PowerSGD (rank 4) and fp16 hooks on the same GPU and gloo", render_cuda_paths,
          rerun="python bench/cuda_paths.py --steps 30"),
)


if __name__ == "__main__":
    main()
