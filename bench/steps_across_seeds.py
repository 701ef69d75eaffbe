"""Steps to a test accuracy across seeds: convoy's strategies against the tuned peers.

    python bench/steps_across_seeds.py --model vgg_fc --seeds 0 1 2 3 4 \\
        --strategies ddp-powersgd-r4 convoy-powersgd-r4

A time-to-accuracy run (bench/time_to_accuracy.py) is one seed: the step at
which a strategy first reaches a target is fixed by the seed (the model's
initialisation and the data order; gloo sums in a fixed order), and from one
seed to the next it moves by an evaluation interval or more. This runs each
strategy of time_to_accuracy, with its flags, at several seeds and reports the
step at which each reached the targets, and per strategy the median over the
seeds. Steps do not depend on the links or on the machine's load, so the ranks
run as local processes (``--hosts`` of them, loopback), several runs at once
with ``--parallel``; they can depend on the kind of CPU (its kernels round
differently), so compare rows measured on one. Writes bench/results/steps_across_seeds_<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import launcher, run_stopping, save, stop_on_sigterm  # noqa: E402
from bench.figures import Block, number, rows_of, table  # noqa: E402
from bench.time_to_accuracy import STOP_WAIT_S, STRATEGIES, TUNED_PEERS, strategy_command, tuned_peer_rank  # noqa: E402

CONVOY_DEFAULT = "convoy-powersgd-r4"   # convoy train --compress powersgd at its default rank


def default_strategies(model: str) -> list[str]:
    """The hook at the rank that reached 97% soonest in the model's time-to-accuracy sweep at 100 Mbit
    (its result file, the one record of that tuning), and convoy's PowerSGD at its default rank."""
    return [f"ddp-powersgd-r{tuned_peer_rank(model, '100mbit')[0]}", CONVOY_DEFAULT]


def run(name: str, seed: int, args: argparse.Namespace, stop: threading.Event) -> dict:
    """The steps at which one strategy's run at ``seed`` first reached each of ``args.targets``
    (``name``: one of time_to_accuracy's strategies or of ``args.extra``); ``stop``: the bench was
    stopped, end the run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run")
        command = strategy_command(name, args, out, args.extra.get(name)) + ["--seed", str(seed)]
        status, stderr, _ = run_stopping(launcher(command, args.hosts, "loopback"), None, STOP_WAIT_S, stop)
        if status != 0:
            raise RuntimeError(f"{name} at seed {seed} failed:\n{stderr[-3000:]}")
        evals = [r for r in map(json.loads, (out / "metrics-rank0.jsonl").read_text().splitlines())
                 if r["kind"] == "eval"]
    row = {"strategy": name, "seed": seed, "final_accuracy": evals[-1]["test_accuracy"],
           "curve": [(e["step"], e["test_accuracy"]) for e in evals]}
    for level in args.targets:
        row[f"steps_to_{level:g}"] = next((e["step"] for e in evals if e["test_accuracy"] >= level), None)
    return row


def medians(rows: list[dict], targets: list[float]) -> list[dict]:
    """Per strategy, the median over seeds of the steps to each target (a seed that never got there
    counts as more steps than any that did) and how many seeds reached it."""
    out = []
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        row = {"strategy": name, "seed": "median"}
        for level in targets:
            key = f"steps_to_{level:g}"
            steps = sorted(r[key] if r[key] is not None else float("inf") for r in mine)
            median = statistics.median_low(steps)
            row[key] = None if median == float("inf") else median
            row[f"seeds_reaching_{level:g}"] = sum(r[key] is not None for r in mine)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4, help="ranks (local processes)")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400, help="give up after this many steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.97],
                        help="accuracies to report; a run stops at the highest")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (steps do not depend on it)")
    parser.add_argument("--tag", help="suffix of the result files' names")
    parser.add_argument("--strategies", nargs="*", choices=list(STRATEGIES),
                        help="default: DDP + PowerSGD at the rank that reached 97%% soonest in the model's "
                        f"time-to-accuracy sweep at 100 Mbit, and {CONVOY_DEFAULT}")
    parser.add_argument("--extra", action="append", default=[], metavar='NAME="FLAGS"',
                        help="another run: a name and its convoy train flags (a setting being tried)")
    args = parser.parse_args()
    if args.strategies is None:
        try:
            args.strategies = default_strategies(args.model)
        except ValueError as exc:   # no sweep for this model
            parser.error(f"{exc}; or name the strategies with --strategies")
    args.target, args.cluster = max(args.targets), None   # what strategy_command reads
    args.extra = {name: ["train", *shlex.split(flags)]
                  for name, _, flags in (extra.partition("=") for extra in args.extra)}
    jobs = [(name, seed) for seed in args.seeds for name in [*args.strategies, *args.extra]]
    stop_on_sigterm()
    stopped = threading.Event()
    with ThreadPoolExecutor(args.parallel) as pool:
        try:
            rows = list(pool.map(lambda job: run(*job, args, stopped), jobs))
        except BaseException:   # the runs in the workers' threads end too, and no queued one starts
            stopped.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for row in rows:
        print({k: v for k, v in row.items() if k != "curve"}, flush=True)
    name = f"steps_across_seeds_{args.model}" + (f"_{args.tag}" if args.tag else "")
    settings = {k: v for k, v in vars(args).items() if k not in ("target", "cluster")}
    keys = [f"steps_to_{level:g}" for level in args.targets]
    save(name, settings, rows + medians(rows, args.targets),
         ["strategy", "seed", *keys, *[f"seeds_reaching_{level:g}" for level in args.targets], "final_accuracy"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_steps_across_seeds(*names: str) -> str:
    """Per strategy, the steps to each target at every seed, then the median over the seeds (the runs
    of ``names``: one run, or several at other seeds of the same strategies)."""
    rows = [r for r in rows_of(*names) if r["seed"] != "median"]
    keys = sorted({k for r in rows for k in r if k.startswith("steps_to_")})
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    # The medians over every file's seeds (one run's stored medians cover only its own seeds).
    overall = {r["strategy"]: r for r in medians(rows, [float(k.removeprefix("steps_to_")) for k in keys])}
    cells = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        by = {r["seed"]: r for r in rows if r["strategy"] == strategy} | {"median": overall[strategy]}
        peer = " (peer)" if strategy in TUNED_PEERS else ""
        for key in keys:
            level = key.removeprefix("steps_to_")
            median = by["median"]
            cells.append([strategy + peer, f"{float(level):.0%}",
                          *[number(by[s].get(key), "-") if s in by else "-" for s in seeds],
                          f"{number(median.get(key), 'not reached')} ({median[f'seeds_reaching_{level}']} of "
                          f"{len(seeds)} reached it)"])
    return table(["strategy", "target", *[f"seed {s}" for s in seeds], "median"], cells)


VGG_FC_RUNS = ("steps_across_seeds_vgg_fc", "steps_across_seeds_vgg_fc_variants", "steps_across_seeds_vgg_fc_hook_r16")
# The hook's and convoy's ranks 4 and 8 (the two sweeps' best on vgg_fc) on an AMD EPYC.
VGG_FC_EPYC_RUNS = ("steps_across_seeds_vgg_fc_epyc",)
# Seeds 0-2, then 3-4 of the same strategies, then convoy's rank 16 without momentum correction.
RESNET18_RUNS = ("steps_across_seeds_resnet18_exp_r16", "steps_across_seeds_resnet18_exp_r16_seeds34",
                 "steps_across_seeds_resnet18_r16_no_mc")
RESNET18_EPYC_RUNS = ("steps_across_seeds_resnet18_epyc_r16",)
def _seeds_block(name: str, title: str, runs: tuple[str, ...], compared: str, rerun: str) -> Block:
    """A documentation block of the seeds tables in ``runs`` (result files, rendered together)."""
    return Block(name, title, runs, compared, partial(render_steps_across_seeds, *runs), rerun=rerun)


BLOCKS = (
    _seeds_block(
        "steps_across_seeds_vgg_fc", "Steps to 95% and 97% across seeds: vgg_fc, 4 ranks", VGG_FC_RUNS,
        "DDP + torch's PowerSGD hook (the rows marked peer) at the rank that reached 97% soonest in the "
        "time-to-accuracy sweep, and at rank 16, at the same seeds; '-': not reached in 400 steps",
        rerun="python bench/steps_across_seeds.py --model vgg_fc --seeds 0 1 2 3 4 --parallel 2"),
    _seeds_block(
        "steps_across_seeds_vgg_fc_epyc", "Steps to 95% and 97% across seeds: vgg_fc, 4 ranks, AMD EPYC",
        VGG_FC_EPYC_RUNS, "DDP + torch's PowerSGD hook (the rows marked peer) at ranks 4 and 8, the soonest to 95% "
        "and to 97% in the time-to-accuracy sweep on the same CPU, at the same seeds; '-': not reached in 400 steps",
        rerun="python bench/steps_across_seeds.py --model vgg_fc --seeds 0 1 2 3 4 --parallel 2 --strategies "
              "ddp-powersgd-r4 ddp-powersgd-r8 convoy-powersgd-r4 convoy-powersgd-r8 --tag epyc"),
    _seeds_block(
        "steps_across_seeds_resnet18", "Steps to 95% and 97% across seeds: resnet18, 4 ranks", RESNET18_RUNS,
        "DDP + torch's PowerSGD hook (the rows marked peer) at ranks 8 (the soonest of the time-to-accuracy "
        "sweep, up to 16 since it was extended) and 16, at the same seeds, evaluated every 25 steps",
        rerun="python bench/steps_across_seeds.py --model resnet18 --eval-every 25 --seeds 0 1 2 3 4 --parallel 2 "
              "--strategies ddp-powersgd-r16 ddp-powersgd-r8 convoy-powersgd-r16"),
    _seeds_block(
        "steps_across_seeds_resnet18_epyc", "Steps to 95% and 97% across seeds: resnet18, 4 ranks, AMD EPYC",
        RESNET18_EPYC_RUNS, "DDP + torch's PowerSGD hook (the rows marked peer) at ranks 8 and 16, the soonest of "
        "the time-to-accuracy sweep on the same CPU, at the same seeds, evaluated every 25 steps",
        rerun="python bench/steps_across_seeds.py --model resnet18 --eval-every 25 --seeds 0 1 2 3 4 --parallel 2 "
              "--strategies ddp-powersgd-r8 ddp-powersgd-r16 convoy-powersgd-r16 --tag epyc_r16"),
)


if __name__ == "__main__":
    main()
