"""Parameter-server step time on an emulated cluster: fifo against graph/timed priorities,
slice sizes and channel counts, and data-parallel all-reduce on the same hosts.

    python bench/ps.py                       # the default grid, about 12 minutes
    python bench/ps.py --full                # every configuration, about 28 minutes
    python bench/ps.py --tta                 # time to 97% test accuracy, vgg_fc on 1 Gbit
    python bench/ps.py --rates 1gbit --models vgg_fc --steps 10

Each row is one `convoy bench cluster --hosts 4 --rate R -- train ...` run
(network namespaces + tbf; root needed): 1 server + 3 workers for PS, 4
workers for all-reduce, digits, batch 16 per worker, lr 0.02. Step time is the
median of the first worker's per-step wall time after two warm-up steps. The
fifo and graph runs of vgg_fc on 100 Mbit record a Chrome trace of two steps,
copied to bench/results/ps_trace_vgg_fc_100mbit_<mode>.json (open it in ui.perfetto.dev).
Results: bench/results/ps.{json,md} (ps_full.{json,md} for --full, ps_time_to_accuracy.{json,md} for --tta). The CPU is shared by the 4 emulated hosts
(2 cores here) and by anything else running: timings are noisy.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.figures import Block, number, percent, rows_of, seconds, table, times  # noqa: E402

HOSTS, SERVERS, BATCH = 4, 1, 16
PS = ["--sync", "ps", "--servers", str(SERVERS)]
# name -> extra `convoy train` arguments
CONFIGS = {
    "allreduce": ["--sync", "allreduce"],
    "fifo": [*PS, "--priority", "fifo"],
    "graph": [*PS, "--priority", "graph"],
    "timed": [*PS, "--priority", "timed"],
    "graph whole tensors": [*PS, "--priority", "graph", "--slice-kb", "1000000"],
    "fifo sliced": [*PS, "--priority", "fifo", "--slice-kb", "256", "--credit-kb", "1024", "--channels", "2"],
    "graph C=1": [*PS, "--priority", "graph", "--channels", "1"],
    "graph C=4": [*PS, "--priority", "graph", "--channels", "4"],
    "graph slice 64 KB": [*PS, "--priority", "graph", "--slice-kb", "64"],
    "graph slice 1 MB": [*PS, "--priority", "graph", "--slice-kb", "1024", "--credit-kb", "4096"],
}
# (model, rate) -> configurations; --full runs all of them (about 28 minutes here).
FULL_GRID = {
    ("vgg_fc", "100mbit"): list(CONFIGS),
    ("vgg_fc", "1gbit"): ["allreduce", "fifo", "graph", "timed"],
    ("resnet18", "1gbit"): ["allreduce", "fifo", "graph", "timed"],
    ("resnet18", "100mbit"): ["allreduce", "fifo", "graph"],
}
# The default (about 12 minutes): the sweeps where the link is the bottleneck.
GRID = {
    ("vgg_fc", "100mbit"): ["allreduce", "fifo", "graph", "timed", "graph whole tensors", "fifo sliced"],
    ("vgg_fc", "1gbit"): ["fifo", "graph", "timed"],
    ("resnet18", "1gbit"): ["fifo", "graph"],
}
# Time to a test accuracy (--tta): vgg_fc on 1 Gbit links, where a step takes about half a second.
# The PS runs 3 workers of 21 samples and all-reduce 4 of 16: global batches of 63 and 64.
TTA = {"model": "vgg_fc", "rate": "1gbit", "configs": ["allreduce", "fifo", "graph"], "target": 0.97,
       "steps": 400, "eval_every": 20, "lr": 0.05, "ps_batch": 21}
STEPS = {("vgg_fc", "100mbit"): 6, ("vgg_fc", "1gbit"): 10, ("resnet18", "1gbit"): 6, ("resnet18", "100mbit"): 5}
TRACED, TRACED_RUNS = ("fifo", "graph"), ("vgg_fc", "100mbit")   # a trace of each, where the link is the bottleneck


def _train(model: str, rate: str, name: str, out: Path, extra: list[str], batch: int = BATCH) -> float:
    """Run one job on the emulated cluster; return its wall time."""
    command = [sys.executable, "-m", "convoy", "bench", "cluster", "--hosts", str(HOSTS), "--rate", rate, "--",
               "train", "--model", model, "--dataset", "digits", "--batch-size", str(batch), "--no-progress",
               "--out", str(out), *CONFIGS[name], *extra]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{model} {rate} {name} failed:\n{result.stderr[-3000:]}")
    return time.monotonic() - start


def _run(model: str, rate: str, name: str, steps: int, out: Path) -> dict:
    traced = name in TRACED and (model, rate) == TRACED_RUNS
    trace = ["--trace", "--trace-steps", "2"] if traced else []
    wall = _train(model, rate, name, out, ["--lr", "0.02", "--steps", str(steps), *trace])
    ps = name != "allreduce"
    worker = SERVERS if ps else 0
    records = [json.loads(line) for line in (out / f"metrics-rank{worker}.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["kind"] == "step"][2:]
    workers = HOSTS - SERVERS if ps else HOSTS
    step_s = statistics.median(r["wall_s"] for r in measured)
    row = {"model": model, "rate": rate, "config": name, "workers": workers, "step_s": step_s,
           "wait_s": statistics.median(r["wait_s"] for r in measured),
           "samples/s": workers * BATCH / step_s,
           "MB_sent/step/worker": statistics.mean(r["bytes_sent"] for r in measured) / 1e6,
           "steps_measured": len(measured), "run_wall_s": wall,
           "step_times": [round(r["wall_s"], 3) for r in measured]}
    if trace and (out / "trace.json").exists():
        RESULTS.mkdir(exist_ok=True)
        target = RESULTS / f"ps_trace_{model}_{rate}_{name}.json"
        shutil.copy(out / "trace.json", target)
        row["trace"] = str(target.relative_to(RESULTS.parent.parent))
    return row


def _time_to_accuracy(name: str, out: Path) -> dict:
    extra = ["--lr", str(TTA["lr"]), "--steps", str(TTA["steps"]), "--eval-every", str(TTA["eval_every"]),
             "--stop-at-accuracy", str(TTA["target"])]
    wall = _train(TTA["model"], TTA["rate"], name, out, extra, BATCH if name == "allreduce" else TTA["ps_batch"])
    records = [json.loads(line) for line in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    hit = next((e for e in evals if e["test_accuracy"] >= TTA["target"]), None)
    return {"model": TTA["model"], "rate": TTA["rate"], "config": name,
            "time_to_target_s": hit["time"] if hit else None, "steps_to_target": hit["step"] if hit else None,
            "final_accuracy": evals[-1]["test_accuracy"], "run_wall_s": wall,
            "curve": [(e["step"], round(e["time"], 2), e["test_accuracy"]) for e in evals]}


def _tta_main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in TTA["configs"]:
            rows.append(_time_to_accuracy(name, Path(tmp, name)))
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
    save("ps_time_to_accuracy", TTA, rows, ["model", "rate", "config", "time_to_target_s", "steps_to_target",
                                            "final_accuracy", "run_wall_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg_fc", "resnet18"])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="override the grid's configurations")
    parser.add_argument("--steps", type=int, help="steps per run (default: per model and rate, 5-10)")
    parser.add_argument("--full", action="store_true", help="every configuration (about 28 minutes)")
    parser.add_argument("--tta", action="store_true", help="only time to 97%% on vgg_fc, 1 Gbit (about 15 minutes)")
    args = parser.parse_args()
    if args.tta:
        return _tta_main()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (model, rate), names in (FULL_GRID if args.full else GRID).items():
            if model not in args.models or rate not in args.rates:
                continue
            for name in args.configs or names:
                steps = args.steps or STEPS[(model, rate)]
                rows.append(_run(model, rate, name, steps, Path(tmp, f"{model}-{rate}-{name}".replace(" ", "_"))))
                print({k: v for k, v in rows[-1].items() if k != "step_times"}, flush=True)
    for row in rows:
        fifo = next((r for r in rows if (r["model"], r["rate"], r["config"]) == (row["model"], row["rate"], "fifo")),
                    None)
        row["speedup_vs_fifo"] = fifo["step_s"] / row["step_s"] if fifo else None
    save("ps_full" if args.full else "ps", vars(args), rows, ["model", "rate", "config", "workers", "step_s", "speedup_vs_fifo", "wait_s",
                                  "samples/s", "MB_sent/step/worker", "steps_measured"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_ps(name: str) -> str:
    rows = rows_of(name)
    return table(["model", "link", "config", "workers", "step", "vs fifo", "samples / s", "steps measured"],
                 [[r["model"], r["rate"], r["config"], str(r["workers"]), seconds(r["step_s"]),
                   times(r["speedup_vs_fifo"]), number(r["samples/s"]), str(r["steps_measured"])]
                  for r in rows])


def render_ps_time_to_accuracy() -> str:
    rows = rows_of("ps_time_to_accuracy")
    return table(["config", "time to 97%", "steps", "final accuracy"],
                 [[r["config"], seconds(r["time_to_target_s"], "not reached"), number(r["steps_to_target"]),
                   percent(r["final_accuracy"])] for r in rows])


BLOCKS = (
    Block("ps", "Parameter server: step time by priority mode (default subset)", ("ps",),
          "FIFO (whole tensors, one channel, no window) and ring all-reduce", partial(render_ps, "ps"),
          rerun="python bench/ps.py", emulated=True),
    Block("ps_full", "Parameter server: every configuration", ("ps_full",), "FIFO and ring all-reduce",
          partial(render_ps, "ps_full"), rerun="python bench/ps.py --full", emulated=True),
    Block("ps_time_to_accuracy", "Parameter server: time to 97%, vgg_fc, 1 Gbit", ("ps_time_to_accuracy",),
          "ring all-reduce with about the same global batch", render_ps_time_to_accuracy,
          rerun="python bench/ps.py --tta", emulated=True),
)


if __name__ == "__main__":
    main()
