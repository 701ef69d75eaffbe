"""What a fixed delay costs in accuracy: `--staleness S`'s update rule simulated in one process.

    python bench/staleness_rules.py --model vgg_fc --lr 0.02 --steps 400 --seeds 0 1

The colocated servers under `--staleness S` apply, at step t, the average of the
workers' gradients taken at the parameters of step t - S, with the optimizer's
momentum and weight decay at the parameters of step t (docs/ps.md, Bounded
staleness). Simulated here on one process, since a world of W workers on the
same global batch averages to the same gradient (the models have no batch
norm): one SGD optimizer on the newest parameters, the gradient computed on a
copy S steps old. Nothing crosses a network, so the runs measure the rule
alone, and variants of it a job could adopt, against the synchronous rule
(S = 0) on the same seeds. Writes bench/results/staleness_rules.{json,md}.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save  # noqa: E402
from bench.figures import Block, number, percent, rows_of, table  # noqa: E402


class Rule(NamedTuple):
    """One update rule: the delay of the gradient, in steps, and what else differs from the job's SGD."""

    delay: int
    lr_factor: float = 1.0
    momentum: float | None = None    # None: --momentum
    synchronous_steps: int = 0       # steps without the delay first
    adam_lr: float | None = None     # Adam at this rate instead of SGD
    look_ahead: bool = False         # the delayed copy moved on by the momentum it will still get (DANA)


VARIANTS: dict[str, Rule] = {
    "synchronous": Rule(0),
    "staleness 2": Rule(2),
    "staleness 2, lr / 3": Rule(2, lr_factor=1 / 3),
    "staleness 2, no momentum, lr x 10": Rule(2, lr_factor=10.0, momentum=0.0),
    "staleness 2 after 150 synchronous steps": Rule(2, synchronous_steps=150),
    "staleness 2, momentum look-ahead": Rule(2, look_ahead=True),
    "synchronous, adam lr 0.0003": Rule(0, adam_lr=3e-4),
    "staleness 2, adam lr 0.0003": Rule(2, adam_lr=3e-4),
}


def simulate(variant: str, seed: int, args: argparse.Namespace) -> dict:
    """Train ``args.model`` on digits under ``variant``'s rule; its accuracy every ``args.eval_every`` steps."""
    import torch
    import torch.nn.functional as F

    from convoy.data.digits import load
    from convoy.models.registry import build_model

    torch.set_num_threads(1)
    rule = VARIANTS[variant]
    delay, synchronous_steps = rule.delay, rule.synchronous_steps
    torch.manual_seed(seed)
    data = load()
    model = build_model(args.model)                        # where the gradient is taken
    newest = [p.detach().clone() for p in model.parameters()]   # the servers' parameters
    for p in newest:
        p.grad = torch.zeros_like(p)
    momentum = args.momentum if rule.momentum is None else rule.momentum
    base_lr = rule.adam_lr or args.lr * rule.lr_factor
    optimizer = (torch.optim.Adam(newest, lr=base_lr, weight_decay=args.weight_decay) if rule.adam_lr else
                 torch.optim.SGD(newest, lr=base_lr, weight_decay=args.weight_decay, momentum=momentum))
    # Momentum alone moves the parameters by lr (m + ... + m^delay) v over the delay's steps.
    ahead = sum(momentum ** k for k in range(1, delay + 1)) if rule.look_ahead else 0.0

    def version(lr: float) -> list[torch.Tensor]:
        buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in newest]
        return [p - lr * ahead * v if ahead and v is not None else p.clone() for p, v in zip(newest, buffers)]

    history = deque([version(base_lr)], maxlen=delay + 1)   # the last delay + 1 versions
    images, labels = data.train.tensors
    test_images, test_labels = data.test.tensors
    order = torch.Generator().manual_seed(seed)
    batch = args.workers * args.batch_size
    curve = []
    for step in range(args.steps):
        if step % (len(labels) // batch) == 0:
            permutation = torch.randperm(len(labels), generator=order)
        index = permutation[(step % (len(labels) // batch)) * batch:][:batch]
        lag = 0 if step < synchronous_steps else min(delay, step - synchronous_steps + 1)
        with torch.no_grad():
            for p, old in zip(model.parameters(), history[-1 - min(lag, len(history) - 1)]):
                p.copy_(old)
        model.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        for p, server in zip(model.parameters(), newest):
            server.grad.copy_(p.grad)
        lr = base_lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))   # convoy's cosine schedule
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        history.append(version(lr))
        if (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                for p, server in zip(model.parameters(), newest):
                    p.copy_(server)
                accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
            curve.append((step + 1, round(accuracy, 4)))
    hit = next((s for s, a in curve if a >= args.target), None)
    return {"variant": variant, "seed": seed, "steps_to_target": hit,
            "best_accuracy": max(a for _, a in curve), "final_accuracy": curve[-1][1], "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (one thread each)")
    args = parser.parse_args()
    runs = [(v, s) for v in args.variants for s in args.seeds]
    with ProcessPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(simulate, *zip(*runs), [args] * len(runs)))
    settings = {k: v for k, v in vars(args).items() if k not in ("parallel", "variants")}
    save("staleness_rules", settings, rows, ["variant", "seed", "steps_to_target", "best_accuracy", "final_accuracy"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_staleness_rules() -> str:
    rows = rows_of("staleness_rules")
    return table(["rule", "seed", "steps to 97%", "best accuracy", "last accuracy"],
                 [[r["variant"], str(r["seed"]), number(r.get("steps_to_target"), "not reached"),
                   percent(r["best_accuracy"]), percent(r["final_accuracy"])] for r in rows])


BLOCKS = (
    Block("staleness_rules", "What a fixed delay of 2 steps costs vgg_fc, simulated in one process",
          ("staleness_rules",), "the synchronous rule (staleness 0) on the same seeds", render_staleness_rules,
          rerun="python bench/staleness_rules.py"),
)


if __name__ == "__main__":
    main()
