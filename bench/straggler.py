"""Time to a test accuracy when one host is slower than the others: all-reduce against
a parameter server whose workers may run ahead (bounded staleness).

    python bench/straggler.py --hosts 4 --rate 100mbit --slow 0.25 --target 0.97

Each strategy runs on a fresh emulated cluster (`convoy bench cluster --cluster
FILE`, root needed) whose last host has a CPU cap of ``--slow`` times the
others' share of the cores. All-reduce waits for the straggler every step; with
``--staleness S`` the other workers run up to S steps ahead of it. Writes
bench/results/straggler_<model>_<rate>.{json,md,png}: per strategy the time and
step at which the target was first reached, the final accuracy and the median
step time, and each strategy's time against all-reduce's.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.time_to_accuracy import _records, plot_curves, step_figures  # noqa: E402

STRATEGIES: dict[str, list[str]] = {
    "allreduce": ["train"],
    "ps-staleness-0": ["train", "--sync", "ps", "--servers", "colocated", "--staleness", "0"],
    "ps-staleness-2": ["train", "--sync", "ps", "--servers", "colocated", "--staleness", "2"],
}


def cluster_file(path: Path, hosts: int, rate: str, slow: float) -> Path:
    """A cluster file whose last host computes at ``slow`` times the others' speed."""
    speeds = ", ".join(["1"] * (hosts - 1) + [f"{slow:g}"])
    path.write_text(f'nodes = {hosts}\nrate = "{rate}"\nspeeds = [{speeds}]\n')
    return path


def run(name: str, args: argparse.Namespace, cluster: Path, out: Path) -> dict:
    command = [*STRATEGIES[name], "--model", args.model, "--lr", str(args.lr), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--stop-at-accuracy", str(args.target), "--no-progress", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "convoy", "bench", "cluster", "--cluster", str(cluster),
                             "--", *command], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    evals = [r for r in _records(out / "metrics-rank0.jsonl") if r["kind"] == "eval"]
    hit = next((e for e in evals if e["test_accuracy"] >= args.target), None)
    return {"strategy": name, "time_to_target_s": hit["time"] if hit else None,
            "steps_to_target": hit["step"] if hit else None, "final_accuracy": evals[-1]["test_accuracy"],
            **step_figures(out), "curve": [(e["time"], e["test_accuracy"]) for e in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each host's link, e.g. 100mbit, 1gbit")
    parser.add_argument("--slow", type=float, default=0.25, help="the last host's speed against the others'")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400, help="give up after this many steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = parser.parse_args()
    if not 0 < args.slow <= 1:
        parser.error(f"--slow must be in (0, 1], got {args.slow}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = cluster_file(Path(tmp, "cluster.toml"), args.hosts, args.rate, args.slow)
        for name in args.strategies:
            try:
                rows.append(run(name, args, cluster, Path(tmp, name)))
            except RuntimeError as exc:   # one failing strategy must not lose the others' figures
                print(exc, file=sys.stderr, flush=True)
                rows.append({"strategy": name, "error": str(exc).splitlines()[-1], "curve": [],
                             "time_to_target_s": None})
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
    base = next((r["time_to_target_s"] for r in rows if r["strategy"] == "allreduce"), None)
    for row in rows:
        t = row["time_to_target_s"]
        row["allreduce/this"] = base / t if base and t else None
    name = f"straggler_{args.model}_{args.rate}"
    save(name, vars(args), rows, ["strategy", "time_to_target_s", "steps_to_target", "allreduce/this",
                                  "final_accuracy", "step_s", "error"])
    plot_curves([r for r in rows if r["curve"]], RESULTS / f"{name}.png", args.target)


if __name__ == "__main__":
    main()
