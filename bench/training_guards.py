"""What the training safeguards cost per step: the divergence check, --clip-grad-norm, --amp bf16.

    python bench/training_guards.py [--models lenet vgg_fc] [--steps 20] [--rounds 2] [--batch 32]

Two gloo workers on loopback, one torch thread each, the engine with SGD and
momentum on random 1x32x32 batches. Modes, run round-robin ``--rounds`` times:

- plain: the engine as ``convoy train`` ran it before these options;
- guard: plus the divergence check every step (``DivergenceGuard``: a 4-byte
  MAX all-reduce of a flag, started each step and read at the next, as the loop does);
- guard_blocking: the same flag all-reduced and waited for at once (the alternative not taken);
- clip: plus ``--clip-grad-norm`` (every update of a step waits for all of its exchanges);
- bf16: plus ``--amp bf16`` (autocast on CPU).

Reported per mode: the median step time and its ratio to plain, measured in the
same run. Every mode includes the engine's own check of the averaged gradient
(one sum per bucket); its time alone, over the model's whole gradient, is the
extra row ``gradient_check``. Writes bench/results/training_guards.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save, spawn  # noqa: E402
from bench.figures import Block, number, rows_of, table  # noqa: E402
from bench.engine_vs_ddp import _batch, _model, _timed  # noqa: E402
from convoy.engine import Engine  # noqa: E402
from convoy.engine.gradients import GradientGate, check_finite  # noqa: E402
from convoy.parallel import DataParallel  # noqa: E402
from convoy.sync import AllReduce  # noqa: E402
from convoy.train.divergence import DivergenceGuard  # noqa: E402

MODES = ("plain", "guard", "guard_blocking", "clip", "bf16")


def _layout(mode: str, name: str, rank: int, world: int) -> DataParallel:
    model = _model(name, 1)
    gate = GradientGate(clip_grad_norm=1.0) if mode == "clip" else None
    engine = Engine(model, torch.optim.SGD, AllReduce(dist.new_group()), gate=gate, lr=0.01, momentum=0.9)
    return DataParallel(model, engine, rank, world, amp="bf16" if mode == "bf16" else None)


def _worker(rank: int, world: int, names: list[str], steps: int, rounds: int, batch: int) -> dict:
    torch.set_num_threads(1)
    x, y = _batch(rank, batch, 1)
    flag_group = dist.new_group()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name in names:
            for mode in MODES:
                layout = _layout(mode, name, rank, world)
                guard = DivergenceGuard(flag_group, "")
                counter = iter(range(10 ** 9))

                def step() -> None:
                    loss, _ = layout.train_step(x, y)
                    if mode == "guard":
                        guard.check(next(counter), loss)
                    elif mode == "guard_blocking":
                        dist.all_reduce(torch.tensor([float(loss)]), op=dist.ReduceOp.MAX, group=flag_group)

                def finish() -> None:
                    guard.finish()
                    layout.engine.synchronize()

                times.setdefault((name, mode), []).extend(_timed(step, finish, steps))
                layout.engine.close()
    return {f"{name}/{mode}": statistics.median(t) for (name, mode), t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["lenet", "vgg_fc"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    medians = spawn(_worker, 2, args.models, args.steps, args.rounds, args.batch)[0]
    rows = []
    for name in args.models:
        plain = medians[f"{name}/plain"]
        rows += [{"model": name, "mode": mode, "step_ms": 1e3 * medians[f"{name}/{mode}"],
                  "vs_plain": medians[f"{name}/{mode}"] / plain} for mode in MODES]
        rows.append({"model": name, "mode": "gradient_check", "step_ms": 1e3 * _check_s(name),
                     "vs_plain": _check_s(name) / plain})
    save("training_guards", vars(args), rows, ["model", "mode", "step_ms", "vs_plain"])


def _check_s(name: str) -> float:
    """Seconds the engine's finiteness check takes over the whole gradient of ``name``, on one thread."""
    torch.set_num_threads(1)
    grad = torch.randn(sum(p.numel() for p in _model(name, 1).parameters()))
    return Timer("check_finite(grad, 0, 'all')", globals={"grad": grad, "check_finite": check_finite}
                 ).blocked_autorange(min_run_time=0.5).median


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_training_guards() -> str:
    rows = rows_of("training_guards")
    return table(["model", "mode", "step", "vs plain"],
                 [[r["model"], r["mode"], f"{r['step_ms']:.3g} ms", number(r["vs_plain"])] for r in rows])


BLOCKS = (
    Block("training_guards", "What the training guards cost", ("training_guards",),
          "the plain engine in the same run", render_training_guards, rerun="python bench/training_guards.py"),
)


if __name__ == "__main__":
    main()
