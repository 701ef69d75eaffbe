"""The comparison suite: every strategy on emulated clusters, one table, plots.

    sudo python bench/suite.py --profile small    # lenet, 100 Mbit and 1 Gbit, about 10 minutes on 2 cores
    sudo python bench/suite.py --profile full     # vgg_fc and resnet18, every strategy (hours)
    sudo python bench/suite.py --profile full --models vgg_fc --rates 1gbit --tag vgg_fc_1gbit   # one setting

For each model and link rate, every strategy of bench/time_to_accuracy.py runs
on 4 emulated hosts (network namespaces + tc) until it reaches the target test
accuracy, its step budget or the profile's time limit (the full profile's is
minutes, so that a dense exchange at 100 Mbit, 10 to 30 minutes to the target,
does not take the suite's hours; such a row reads "not reached in N s").
Beside them the suite measures the physical limits of that setting: the
compute-only step (4 single-process runs at once, so the CPU is shared as in
the cluster, and nothing is exchanged) and the bandwidth-optimal ring
all-reduce of the model's fp32 gradients,
2 (N - 1) / N x bytes / rate. Each strategy's step time is reported as a ratio
to the larger of the two.

Writes bench/results/suite_<profile>[_<tag>].{json,md} (the machine, the commit and
the settings with every row), accuracy_<model>_<rate>.png (test accuracy
against wall time per strategy) and bytes.png under bench/results/suite_<profile>[_<tag>]/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save, stop_on_sigterm  # noqa: E402
from bench.figures import Block, Row, number, percent, rows_of, seconds, table, times  # noqa: E402
from bench.time_to_accuracy import (CONVOY_POWERSGD_SWEEP, STRATEGIES, TUNED_PEERS, plot_curves,  # noqa: E402
                                     run_strategy)
from convoy.emulation import parse_rate  # noqa: E402


@dataclass(frozen=True)
class Profile:
    models: tuple[str, ...]
    rates: tuple[str, ...]
    strategies: tuple[str, ...]
    steps: int
    eval_every: int
    lr: float
    batch_size: int
    hosts: int = 4
    target: float = 0.97
    # convoy's compressors warm up as convoy train's defaults have them (None), as a user's run would.
    warmup_steps: int | None = None
    # A run that has not reached the target by then is stopped and reported as such (None: no limit).
    time_limit_s: float | None = None


PROFILES = {
    "small": Profile(models=("lenet",), rates=("100mbit", "1gbit"),
                     strategies=("ddp", "dense", "topk", "blocktopk-10%", "hybrid-3+1", "hierarchical",
                                 "ps-fifo", "ps-graph"),
                     steps=300, eval_every=25, lr=0.05, batch_size=32),
    # torch DDP, the peers a DDP user tunes among (the PowerSGD hook's rank sweep, its warm-up, the fp16
    # hook), then every technique of convoy's.
    "full": Profile(models=("vgg_fc", "resnet18"), rates=("100mbit", "1gbit"),
                    strategies=("ddp", *TUNED_PEERS, "dense", *CONVOY_POWERSGD_SWEEP, "fp16", "topk", "blocktopk",
                                "blocktopk-10%", "hybrid-3+1", "hybrid-2+2", "hierarchical", "ps-fifo", "ps-graph"),
                    steps=400, eval_every=25, lr=0.02, batch_size=16,
                    # Long enough for every strategy within 3x of the best tuned peer at 100 Mbit
                    # (about 60-80 s); a dense exchange at 100 Mbit would take 10-30 minutes a run.
                    time_limit_s=300),
}


def compute_only_step_s(model: str, profile: Profile) -> float:
    """Median step of ``hosts`` concurrent one-process runs: the compute each host gets, with no exchange."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", "convoy", "train", "--nproc", "1", "--model", model,
                                   "--batch-size", str(profile.batch_size), "--lr", str(profile.lr),
                                   "--steps", "30", "--no-progress", "--out", f"{tmp}/{i}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(profile.hosts)]
        for proc in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"compute-only run failed: {proc.stderr.read()[-2000:]}")
        steps = [json.loads(line)["wall_s"] for i in range(profile.hosts)
                 for line in Path(tmp, str(i), "metrics-rank0.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "step"][5:]
    return statistics.median(steps)


def ring_allreduce_s(model: str, hosts: int, rate: str) -> float:
    """The bandwidth-optimal ring all-reduce of the model's fp32 gradients over links of ``rate``."""
    from convoy.models import build_model
    from convoy.data import build_dataset

    data = build_dataset("digits")
    net = build_model(model, in_channels=data.in_channels, num_classes=data.num_classes, image_size=data.image_size)
    grad_bytes = 4 * sum(p.numel() for p in net.parameters())
    return 2 * (hosts - 1) / hosts * grad_bytes * 8 / parse_rate(rate)


def run_setting(model: str, rate: str, profile: Profile, out: Path) -> list[dict]:
    args = argparse.Namespace(model=model, rate=rate, cluster=None, **{k: v for k, v in asdict(profile).items()
                                                        if k not in ("models", "rates", "strategies",
                                                                     "time_limit_s")})
    compute = compute_only_step_s(model, profile)
    ring = ring_allreduce_s(model, profile.hosts, rate)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in profile.strategies:
            try:
                row = run_strategy(name, args, Path(tmp, name), profile.time_limit_s)
            except RuntimeError as exc:   # one failing strategy must not lose the others' figures
                print(f"suite: {model} {rate} {name} failed: {str(exc).splitlines()[-1]}", flush=True)
                row = {"strategy": name, "error": str(exc).splitlines()[-1], "curve": []}
            row.update(model=model, rate=rate, compute_only_s=compute, ring_allreduce_s=ring)
            if row.get("step_s"):
                row["step_vs_limit"] = row["step_s"] / max(compute, ring)
            rows.append(row)
            print({k: v for k, v in row.items() if k != "curve"}, flush=True)
    dense = next((r.get("time_to_target_s") for r in rows if r["strategy"] == "dense"), None)
    for row in rows:
        t = row.get("time_to_target_s")
        row["speedup_vs_dense"] = dense / t if dense and t else None
    plot_curves([r for r in rows if r["curve"]], out / f"accuracy_{model}_{rate}.png", profile.target)
    return rows


def plot_bytes(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "MB_sent/step" in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']} {r['rate']}\n{r['strategy']}" for r in shown]
    ax.bar(range(len(shown)), [r["MB_sent/step"] for r in shown])
    ax.set_xticks(range(len(shown)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("MB sent per worker per step")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=list(PROFILES), default="small")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES),
                        help="run only these strategies of the profile")
    parser.add_argument("--models", nargs="+", help="run only these models of the profile")
    parser.add_argument("--rates", nargs="+", help="run only these link rates of the profile")
    parser.add_argument("--steps", type=int, help="the step budget per run instead of the profile's")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop a run that has not reached the target after this long, instead of the "
                             "profile's limit (full: %g s)" % PROFILES["full"].time_limit_s)
    parser.add_argument("--tag", help="suffix of the result files' names, to keep partial runs apart")
    args = parser.parse_args()
    stop_on_sigterm()
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit must be positive seconds, got {args.time_limit:g}")
    chosen = {"strategies": args.strategies, "models": args.models, "rates": args.rates, "steps": args.steps,
              "time_limit_s": args.time_limit}
    profile = Profile(**{**asdict(PROFILES[args.profile]),
                         **{k: tuple(v) if isinstance(v, list) else v for k, v in chosen.items() if v}})
    name = f"suite_{args.profile}" + (f"_{args.tag}" if args.tag else "")
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for model in profile.models for rate in profile.rates
            for row in run_setting(model, rate, profile, out)]
    plot_bytes(rows, out / "bytes.png")
    save(name, asdict(profile), rows,
         ["model", "rate", "strategy", "step_s", "step_vs_limit", "time_to_target_s", "speedup_vs_dense",
          "steps_to_target", "time_limit_s", "final_accuracy", "MB_sent/step", "compute_only_s",
          "ring_allreduce_s", "error"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

# The full profile's result files of each setting (--tag kept partial runs apart).
SUITE_FILES = {
    ("vgg_fc", "1gbit"): ("suite_full_vgg_fc",),
    ("vgg_fc", "100mbit"): ("suite_full_vgg_fc",),
    ("resnet18", "1gbit"): ("suite_full_resnet18_1gbit_a", "suite_full_resnet18_1gbit_b",
                            "suite_full_resnet18_1gbit_c"),
    ("resnet18", "100mbit"): ("suite_full_resnet18_100mbit_a", "suite_full_resnet18_100mbit_b",
                              "suite_full_resnet18_100mbit_c", "suite_full_resnet18_100mbit_blocktopk_global",
                              "suite_full_resnet18_100mbit_ps"),
}


def suite_files(model: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for (m, _), names in SUITE_FILES.items() if m == model for name in names))


def _not_reached(row: Row) -> str:
    limit = row.get("time_limit_s")
    return f"not reached in {limit:g} s" if limit else "not reached"


def render_suite(*names: str) -> str:
    rows = rows_of(*names)
    dense = {(r["model"], r["rate"]): r for r in rows if r["strategy"] == "dense"}

    def speedup(r: Row) -> str:
        d = dense.get((r["model"], r["rate"]))
        return times(d["time_to_target_s"] / r["time_to_target_s"]) \
            if d and d["time_to_target_s"] and r["time_to_target_s"] else "-"
    return table(["model", "links", "strategy", "step", "step / limit", "time to 97%", "vs convoy all-reduce",
                  "accuracy at the end", "MB / step / worker"],
                 [[r["model"], r["rate"], r["strategy"], seconds(r["step_s"]), number(r["step_vs_limit"]),
                   seconds(r["time_to_target_s"], _not_reached(r))
                   + (f" (step {r['steps_to_target']})" if r["steps_to_target"] else ""),
                   speedup(r), percent(r["final_accuracy"]), number(r["MB_sent/step"])] for r in rows])


def render_headline() -> str:
    """vgg_fc's time to 97% per strategy at both link rates, from the full suite: against torch DDP and,
    where the suite ran them, against the soonest of the tuned peers at that rate."""
    rows = rows_of(*suite_files("vgg_fc"))
    by = {(r["rate"], r["strategy"]): r for r in rows}
    strategies = list(dict.fromkeys(s for _, s in by))
    best_peer = {rate: min((r for r in rows if r["rate"] == rate and r["strategy"] in TUNED_PEERS
                            and r["time_to_target_s"]), key=lambda r: r["time_to_target_s"], default=None)
                 for rate in ("100mbit", "1gbit")}

    def ratio(r: Row, reference: Row | None) -> str:
        return f", {times(reference['time_to_target_s'] / r['time_to_target_s'])}" \
            if reference and reference["time_to_target_s"] else ""

    def cell(rate: str, strategy: str, versus: Row | None) -> str:
        r = by.get((rate, strategy))
        if r is None:
            return "-"
        if not r["time_to_target_s"]:
            return f"{_not_reached(r)} ({percent(r['final_accuracy'])})"
        return f"{seconds(r['time_to_target_s'])}{ratio(r, versus)}"
    if not any(best_peer.values()):   # a suite from before the tuned peers
        return table(["strategy", "100 Mbit: time to 97%, vs torch DDP", "1 Gbit: time to 97%, vs torch DDP"],
                     [[s, cell("100mbit", s, by.get(("100mbit", "ddp"))), cell("1gbit", s, by.get(("1gbit", "ddp")))]
                      for s in strategies])
    names = {rate: peer["strategy"] if peer else "none reached it" for rate, peer in best_peer.items()}
    return table(["strategy", f"100 Mbit: time to 97%, vs the best tuned peer ({names['100mbit']})",
                  f"1 Gbit: time to 97%, vs the best tuned peer ({names['1gbit']})"],
                 [[s, cell("100mbit", s, best_peer["100mbit"]), cell("1gbit", s, best_peer["1gbit"])]
                  for s in strategies])


BLOCKS = (
    Block("headline", "vgg_fc to 97% on 4 emulated hosts, every strategy", suite_files("vgg_fc"),
          "torch DDP, or where the suite ran them the soonest of the tuned peers at each rate (the ratio: its time "
          "over the strategy's)", render_headline,
          rerun="python bench/suite.py --profile full --models vgg_fc --tag vgg_fc", emulated=True),
    Block("suite_small", "The comparison suite, small profile (lenet)", ("suite_small",), "torch DDP",
          partial(render_suite, "suite_small"), rerun="python bench/suite.py --profile small", emulated=True),
    Block("suite_vgg_fc", "The comparison suite, full profile: vgg_fc", suite_files("vgg_fc"),
          "torch DDP, the tuned peers (DDP + torch's PowerSGD hook at each rank of its rows, rank 4 with 10% "
          "dense warm-up, DDP's fp16 hook) and convoy's all-reduce (dense), in the same run",
          partial(render_suite, *suite_files("vgg_fc")),
          rerun="python bench/suite.py --profile full --models vgg_fc --tag vgg_fc", emulated=True),
    Block("suite_resnet18", "The comparison suite, full profile: resnet18", suite_files("resnet18"),
          "torch DDP and DDP + PowerSGD rank 2", partial(render_suite, *suite_files("resnet18")),
          rerun="python bench/suite.py --profile full --models resnet18 --rates 1gbit|100mbit [--strategies ...] "
                "--tag TAG", emulated=True),
)


if __name__ == "__main__":
    main()
