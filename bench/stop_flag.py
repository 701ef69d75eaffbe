"""What the stop signal costs the divergence guard's per-step agreement.

The guard all-reduces a finite-loss flag each step (read one step later); the
graceful stop adds the signal and the first/last rank signalled to it: four
float64s instead of one float32. Both are timed here in the same processes,
interleaved, with a fixed amount of compute between checks standing in for a
step (so the asynchronous collective has something to hide behind, as in training).

    python bench/stop_flag.py --steps 2000 --world 2

Prints a table and writes bench/results/stop_flag.{json,md}.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402
from bench.figures import Block, rows_of, table  # noqa: E402
from convoy.train.divergence import DivergenceGuard  # noqa: E402
from convoy.utils.spawn import run_in_processes  # noqa: E402


class LossOnlyGuard:
    """The guard as it was before the stop signal: one float32 flag, MAX, read a step later."""

    def __init__(self, group: dist.ProcessGroup):
        self._group, self._pending = group, None

    def check(self, step: int, loss: float) -> None:
        if self._pending is not None:
            flag, work = self._pending
            work.wait()
            assert flag.item() == 0
        flag = torch.tensor([0.0 if math.isfinite(loss) else 1.0])
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True))


def _time(rank: int, world: int, steps: int, rounds: int) -> dict[str, list[float]]:
    group = dist.new_group()
    a, b = torch.randn(96, 96), torch.randn(96, 96)
    guards = {"loss flag only (before)": LossOnlyGuard(group), "loss flag + stop signal (now)": DivergenceGuard(group, "")}
    out: dict[str, list[float]] = {name: [] for name in guards}
    out["no check"] = []
    for _ in range(rounds):   # interleaved rounds: the machine's load changes alike for all three
        for name in ["no check", *guards]:
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                torch.mm(a, b)   # a stand-in for the step's compute
                if name in guards:
                    guards[name].check(step, 1.0)
            out[name].append((time.perf_counter() - start) / steps * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    results = run_in_processes(_time, args.world, args.steps, args.rounds)[0]
    base = min(results["no check"])
    rows = [{"variant": name, "us_per_step_best": round(min(v), 2), "us_per_step_median": round(sorted(v)[len(v) // 2], 2),
             "check_us": round(min(v) - base, 2)} for name, v in results.items()]
    settings = {"steps": args.steps, "rounds": args.rounds, "world": args.world, "backend": "gloo",
                "note": "shared machine: absolute times inflated; compare within the run"}
    save("stop_flag", settings, rows, ["variant", "us_per_step_best", "us_per_step_median", "check_us"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_stop_flag() -> str:
    return table(["variant", "us / step (best)", "median", "check cost us"],
                 [[r["variant"], f"{r['us_per_step_best']:.0f}", f"{r['us_per_step_median']:.0f}",
                   f"{r['check_us']:.0f}"] for r in rows_of("stop_flag")])


BLOCKS = (
    Block("stop_flag", "What the stop signal adds to the guard's per-step flag", ("stop_flag",),
          "the loss flag alone (before the stop signal travelled in it)", render_stop_flag,
          rerun="python bench/stop_flag.py --steps 1000 --rounds 5 --world 2"),
)


if __name__ == "__main__":
    main()
