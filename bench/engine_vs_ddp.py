"""Step time of convoy's pipelined engine against torch DDP, same model, data and world size.

    python bench/engine_vs_ddp.py [--models vgg_fc resnet18] [--worlds 2 4] [--steps 20] [--round-steps 2]

Loopback gloo, one torch thread per worker. Writes bench/results/engine_vs_ddp.{json,md}.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save, spawn, timed_round  # noqa: E402
from bench.figures import Block, number, rows_of, seconds, table  # noqa: E402
from convoy.engine import Engine  # noqa: E402
from convoy.engine.engine import DEFAULT_BUCKET_BYTES  # noqa: E402
from convoy.models import build_model  # noqa: E402
from convoy.sync import AllReduce  # noqa: E402

WARMUP = 2


def _model(name: str, channels: int) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, in_channels=channels, num_classes=10)


def _batch(rank: int, batch: int, channels: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, channels, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _timed(step, finish, steps: int) -> list[float]:
    for _ in range(WARMUP):
        step()
    finish()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    finish()
    times[-1] += time.perf_counter() - start
    return times


def worker(rank: int, world: int, name: str, batch: int, steps: int, rounds: int, channels: int,
           bucket_kb: int) -> dict:
    """Engine and DDP rounds interleaved (the order alternates), so a burst of load from
    other jobs hits both; the figure is the median of the per-round ratios."""
    x, y = _batch(rank, batch, channels)
    model = _model(name, channels)
    strategy = AllReduce(dist.new_group())
    engine = Engine(model, torch.optim.SGD, strategy, lr=0.01, momentum=0.9, bucket_bytes=bucket_kb * 1024)
    ddp = nn.parallel.DistributedDataParallel(_model(name, channels))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def engine_step():
        engine.backward(F.cross_entropy(model(x), y))

    def ddp_step():
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    methods = {"engine": (engine_step, engine.synchronize), "ddp": (ddp_step, lambda: None)}
    for step, finish in methods.values():   # warm-up: allocations, first-step set-up
        timed_round(step, finish, WARMUP)
    first_timed = engine.step
    out: dict = {"engine": [], "ddp": [], "engine_cpu": [], "ddp_cpu": []}
    for r in range(rounds):
        order = ("engine", "ddp") if r % 2 == 0 else ("ddp", "engine")
        for method in order:
            wall, cpu = timed_round(*methods[method], steps)
            out[method].append(wall)
            out[f"{method}_cpu"].append(cpu)
    out["wait"] = [engine.stats(s).wait_s for s in range(first_timed, engine.step)]
    out["bytes_per_step"] = strategy.bytes_sent / engine.step
    engine.close()
    return out


def _spread(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3f}-{hi:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg_fc", "resnet18"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method, split into rounds")
    parser.add_argument("--round-steps", type=int, default=2, help="steps per round (engine and DDP alternate)")
    parser.add_argument("--batch", type=int, default=16, help="samples per worker")
    parser.add_argument("--bucket-kb", nargs="+", type=int, default=[DEFAULT_BUCKET_BYTES // 1024],
                        help="engine bucket sizes to measure (default: the engine's; 0: one layer per exchange)")
    args = parser.parse_args()
    rounds = max(1, args.steps // args.round_steps)
    rows = []
    for name in args.models:
        channels = 3 if name == "resnet18" else 1
        for world, bucket_kb in itertools.product(args.worlds, args.bucket_kb):
            results = spawn(worker, world, name, args.batch, args.round_steps, rounds, channels, bucket_kb)
            # A round is as slow as its slowest rank.
            engine = [max(r["engine"][i] for r in results) for i in range(rounds)]
            ddp = [max(r["ddp"][i] for r in results) for i in range(rounds)]
            ratios = [e / d for e, d in zip(engine, ddp)]
            cpu = [sum(r["engine_cpu"][i] for r in results) / sum(r["ddp_cpu"][i] for r in results)
                   for i in range(rounds)]
            rows.append({"model": name, "world": world, "batch/worker": args.batch, "bucket_kb": bucket_kb,
                         "rounds": rounds, "engine_step_s": statistics.median(engine),
                         "ddp_step_s": statistics.median(ddp), "engine/ddp": statistics.median(ratios),
                         "ratio_range": _spread(ratios), "cpu_engine/ddp": statistics.median(cpu),
                         "engine_samples_s": world * args.batch / statistics.median(engine),
                         "ddp_samples_s": world * args.batch / statistics.median(ddp),
                         "engine_wait_s": statistics.median(results[0]["wait"]),
                         "MB_sent/step": results[0]["bytes_per_step"] / 1e6})
            print(rows[-1], flush=True)
    settings = {**vars(args), "rounds": rounds,
                "note": "engine/ddp is the median over rounds of (engine round / adjacent DDP round), wall "
                        "time; cpu_engine/ddp the same for the CPU time of every thread of the workers; "
                        "2-core machine shared with other jobs: absolute times are inflated"}
    save("engine_vs_ddp", settings, rows,
         ["model", "world", "batch/worker", "bucket_kb", "rounds", "engine_step_s", "ddp_step_s", "engine/ddp",
          "ratio_range", "cpu_engine/ddp", "engine_samples_s", "ddp_samples_s", "engine_wait_s", "MB_sent/step"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_engine_vs_ddp() -> str:
    rows = rows_of("engine_vs_ddp")
    return table(["model", "workers", "bucket KB", "engine step", "DDP step", "engine / DDP",
                  "engine waiting on comm", "MB sent / step / worker"],
                 [[r["model"], str(r["world"]), number(r.get("bucket_kb")), seconds(r["engine_step_s"]),
                   seconds(r["ddp_step_s"]), number(r["engine/ddp"]), seconds(r["engine_wait_s"]),
                   number(r["MB_sent/step"])] for r in rows])


BLOCKS = (
    Block("engine_vs_ddp", "Engine against torch DDP, loopback", ("engine_vs_ddp",),
          "torch DDP, same model, data, initialisation and optimizer", render_engine_vs_ddp,
          rerun="python bench/engine_vs_ddp.py --models vgg_fc resnet18 --worlds 2 --steps 20"),
)


if __name__ == "__main__":
    main()
