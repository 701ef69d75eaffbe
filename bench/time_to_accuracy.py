"""Time to a test accuracy for several strategies on an emulated cluster with shaped links.

    python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --target 0.97 \\
        --strategies dense ddp powersgd topk blocktopk

Each strategy is one `convoy bench cluster` run (network namespaces + tbf; root
needed) that stops at the target accuracy or after --steps. Reports per
strategy the wall time and step at which the target was first reached, the
median step time and bytes sent per step, and writes
bench/results/time_to_accuracy_<model>_<rate>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402

PEER = str(Path(__file__).resolve().parent / "peers" / "ddp_train.py")

# name -> how the ranks are started (after `convoy bench cluster ... --`).
STRATEGIES: dict[str, list[str]] = {
    "dense": ["train"],
    "fp16": ["train", "--compress", "fp16"],
    "topk": ["train", "--compress", "topk"],
    "blocktopk": ["train", "--compress", "blocktopk", "--block-fraction", "0.01"],
    "blocktopk-global": ["train", "--compress", "blocktopk", "--block-fraction", "0.01",
                         "--block-selection", "global"],
    "hybrid-3+1": ["train", "--parallel", "hybrid", "--conv-workers", "3", "--fc-workers", "1"],
    "hybrid-2+2": ["train", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "2"],
    "ddp": [PEER],
    "powersgd": [PEER, "--powersgd-rank", "2"],
}


def _run(name: str, args: argparse.Namespace, out: Path) -> dict:
    common = ["--model", args.model, "--lr", str(args.lr), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--stop-at-accuracy", str(args.target), "--out", str(out)]
    command = STRATEGIES[name] + common + (["--no-progress"] if STRATEGIES[name][0] == "train" else [])
    cluster = [sys.executable, "-m", "convoy", "bench", "cluster", "--hosts", str(args.hosts), "--rate", args.rate]
    result = subprocess.run(cluster + ["--"] + command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    hit = next((e for e in evals if e["test_accuracy"] >= args.target), None)
    return {"strategy": name, "time_to_target_s": hit["time"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "final_accuracy": evals[-1]["test_accuracy"],
            "step_s": statistics.median(r["wall_s"] for r in steps[1:]),
            "MB_sent/step": statistics.mean(r["bytes_sent"] for r in steps) / 1e6,
            "curve": [(e["time"], e["test_accuracy"]) for e in evals]}


def _plot(rows: list[dict], path: Path, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        times, accs = zip(*row["curve"])
        ax.plot(times, [100 * a for a in accs], marker="o", markersize=3, label=row["strategy"])
    ax.axhline(100 * target, color="grey", linestyle=":")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400, help="give up after this many steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies:
            rows.append(_run(name, args, Path(tmp, name)))
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
    dense = next((r["time_to_target_s"] for r in rows if r["strategy"] == "dense"), None)
    for row in rows:
        t = row["time_to_target_s"]
        row["speedup_vs_dense"] = dense / t if dense and t else None
    name = f"time_to_accuracy_{args.model}_{args.rate}"
    save(name, vars(args), rows, ["strategy", "time_to_target_s", "steps_to_target", "speedup_vs_dense",
                                  "final_accuracy", "step_s", "MB_sent/step"])
    _plot(rows, RESULTS / f"{name}.png", args.target)


if __name__ == "__main__":
    main()
