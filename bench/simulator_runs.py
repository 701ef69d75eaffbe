"""Short runs on an emulated cluster to check the simulator against: the step time of each strategy.

Runs each strategy of ``bench/time_to_accuracy.py``'s table (the same flags),
and a few more that ``convoy plan`` may pick, for 24 steps with ``convoy bench
cluster`` (root); the step is ``time_to_accuracy.step_figures``' mean over every
rank's steps after the first 4. Writes
bench/results/simulator_runs_<model>_<rate>.json in the time-to-accuracy
schema (``settings`` + ``rows`` with ``strategy`` and ``step_s``), which
``bench/simulator_validation.py`` reads::

    python bench/simulator_runs.py --rate 100mbit --strategies fp16 topk blocktopk powersgd
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.figures import Block, number, rows_of, seconds, table  # noqa: E402
from bench.time_to_accuracy import STRATEGIES as PEER_TABLE, step_figures  # noqa: E402

# The time-to-accuracy strategies, and settings convoy plan ranks high on slow links.
STRATEGIES = {**PEER_TABLE,
              "blocktopk-k1": ["train", "--compress", "blocktopk", "--blocks-per-layer", "1"],
              "randomk": ["train", "--compress", "randomk", "--element-fraction", "0.01"],
              "ps2-fifo": ["train", "--sync", "ps", "--servers", "2", "--priority", "fifo"],
              "ps2-graph": ["train", "--sync", "ps", "--servers", "2", "--priority", "graph"]}


def foreign_jobs() -> int:
    """Training processes on this machine that are not ours (other benchmarks, tests)."""
    mine = str(os.getpid())
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines()
               if ("convoy train" in line or "-m convoy" in line or "ddp_train.py" in line or "pytest" in line)
               and mine not in line.split()[:2] and "simulator_runs" not in line)


def wait_for_quiet(limit_s: float) -> bool:
    """Wait until no other emulated cluster is up and no other training job runs (this
    machine is shared: their processes would take the 2 cores from our ranks); False
    if that did not happen within ``limit_s`` (0: do not wait)."""
    if limit_s <= 0:
        return True
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if not any(line.startswith("convoy") for line in names.splitlines()) and foreign_jobs() == 0:
            return True
        time.sleep(2)
    return False


def run_one(name: str, args: argparse.Namespace, out_dir: Path) -> dict | None:
    """The strategy's median step, or None when the machine stayed busy."""
    if not wait_for_quiet(args.wait_s):
        print(f"skipped {name}: the machine stayed busy", flush=True)
        return None
    load_before = os.getloadavg()[0]
    own = ["--no-progress"] if STRATEGIES[name][0] == "train" else []
    command = STRATEGIES[name] + ["--model", args.model, "--batch-size", str(args.batch_size), "--lr", "0.02",
                                  "--steps", str(args.steps), "--out", str(out_dir)] + own
    cluster = [sys.executable, "-m", "convoy", "bench", "cluster", "--hosts", str(args.hosts), "--rate", args.rate]
    log = open(f"{out_dir}.log", "w+")   # a file, not a pipe: nobody reads while the job runs
    job = subprocess.Popen(cluster + ["--"] + command, stdout=log, stderr=subprocess.STDOUT, text=True)
    # Watch for other jobs starting meanwhile: the row records the most seen at once.
    # Our own ranks run under the cluster's PID; they are told apart by their --out.
    intruders = 0
    while job.poll() is None:
        out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        intruders = max(intruders, sum(1 for line in out.splitlines() if ("convoy train" in line or "ddp_train.py"
                                       in line or "pytest" in line) and str(out_dir) not in line))
        time.sleep(1)
    log.seek(0)
    if job.returncode != 0:
        raise SystemExit(f"{name} failed:\n{log.read()[-3000:]}")
    log.close()
    # The first steps build buckets and warm the caches; PowerSGD starts at step 2.
    return {"strategy": name, "flags": STRATEGIES[name], **step_figures(out_dir, skip=4),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "other_jobs": intruders}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--wait-s", type=float, default=900, help="give up on a strategy after waiting this long "
                        "for the machine to be free of other jobs (0: run at once; the row counts the other jobs)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = parser.parse_args()
    name = f"simulator_runs_{args.model}_{args.rate}"
    # Rows of earlier runs stay unless measured again (runs wait for a quiet machine, so come piecemeal).
    rows = {r["strategy"]: r for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]} \
        if (RESULTS / f"{name}.json").exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            row = run_one(strategy, args, Path(tmp, strategy))
            if row:
                rows[strategy] = row
                print(row, flush=True)
                save(name, vars(args), list(rows.values()),
                     ["strategy", "step_s", "MB_sent/step", "load_before", "load_after", "other_jobs"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

SIM_RUNS = tuple(f"simulator_runs_{m}_{r}" for m in ("vgg_fc", "resnet18") for r in ("100mbit", "1gbit"))


def render_steady_steps() -> str:
    cells = []
    for model in ("vgg_fc", "resnet18"):
        by_rate = {rate: {r["strategy"]: r for r in rows_of(f"simulator_runs_{model}_{rate}")}
                   for rate in ("100mbit", "1gbit")}
        for strategy in dict.fromkeys(s for rows in by_rate.values() for s in rows):
            slow, fast = by_rate["100mbit"].get(strategy, {}), by_rate["1gbit"].get(strategy, {})
            cells.append([model, strategy, seconds(slow.get("step_s")), seconds(fast.get("step_s")),
                          number((slow or fast).get("MB_sent/step"))])
    return table(["model", "strategy", "step at 100 Mbit", "step at 1 Gbit", "MB / step / worker"], cells)


BLOCKS = (
    Block("simulator_runs", "Steady step of every strategy, 4 emulated hosts", SIM_RUNS,
          "torch DDP and DDP + PowerSGD (rows ddp, powersgd)", render_steady_steps,
          rerun="python bench/simulator_runs.py --model vgg_fc|resnet18 --rate 100mbit|1gbit", emulated=True),
)


if __name__ == "__main__":
    main()
