"""Hybrid (conv data-parallel + FC data-parallel + link) against pure data parallelism, 4 processes.

    python bench/hybrid.py [--models vgg_fc resnet18] [--steps 30]

Each row is one `convoy train` run on loopback with the same global batch (48
samples: 4 x 12 for data parallelism, 3 x 16 for hybrid 3+1, 2 x 24 for 2+2).
Per worker and step it reports the bytes of the gradient rings (the engine's
all-reduce payloads) and of the conv<->FC link, the median step time, and the
peak resident memory of the conv (or data-parallel) and FC ranks, and
writes bench/results/hybrid.{json,md}. Time to accuracy on a shaped cluster:
bench/time_to_accuracy.py --strategies dense hybrid-3+1 hybrid-2+2.
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
from bench.common import save  # noqa: E402
from bench.figures import Block, number, rows_of, seconds, table  # noqa: E402

LAYOUTS = {
    "data 4": ["--batch-size", "12"],
    "hybrid 3+1": ["--batch-size", "16", "--parallel", "hybrid", "--conv-workers", "3", "--fc-workers", "1"],
    "hybrid 2+2": ["--batch-size", "24", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "2"],
    "hybrid 3+1 K=4": ["--batch-size", "16", "--parallel", "hybrid", "--conv-workers", "3", "--fc-workers", "1",
                       "--sub-batches", "4"],
}
CONV_RANKS = {"hybrid 3+1": 3, "hybrid 2+2": 2, "hybrid 3+1 K=4": 3}


def _run(model: str, layout: str, steps: int, out: Path) -> dict:
    channels = ["--dataset", "synthetic", "--synthetic-shape", "3,32,32"] if model == "resnet18" else []
    command = [sys.executable, "-m", "convoy", "train", "--nproc", "4", "--model", model, "--steps", str(steps),
               "--lr", "0.02", "--no-progress", "--out", str(out), *channels, *LAYOUTS[layout]]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{model} {layout} failed:\n{result.stderr[-3000:]}")
    per_rank = []
    for rank in range(4):
        records = [json.loads(line) for line in (out / f"metrics-rank{rank}.jsonl").read_text().splitlines()]
        per_rank.append([r for r in records if r["kind"] == "step"][2:])  # skip warm-up steps
    ring = [statistics.mean(r["bytes_sent"] for r in steps) for steps in per_rank]
    link = [statistics.mean(r.get("link_bytes_sent", 0) for r in steps) for steps in per_rank]
    step_s = statistics.median(max(steps[i]["wall_s"] for steps in per_rank) for i in range(len(per_rank[0])))
    peak = [steps[-1]["peak_rss_mb"] for steps in per_rank]
    convs = CONV_RANKS.get(layout, 4)
    return {"peak_MB_conv_or_data": max(peak[:convs]), "peak_MB_fc": max(peak[convs:], default=None),
            "model": model, "layout": layout, "ring_MB/step/worker": statistics.mean(ring) / 1e6,
            "link_MB/step/worker": statistics.mean(link) / 1e6,
            "total_MB/step/worker": (statistics.mean(ring) + statistics.mean(link)) / 1e6,
            "max_MB/step/worker": max(r + l for r, l in zip(ring, link)) / 1e6, "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg_fc", "resnet18"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for layout in LAYOUTS:
                rows.append(_run(model, layout, args.steps, Path(tmp, f"{model}-{layout}".replace(" ", "_"))))
                print(rows[-1], flush=True)
            data = next(r for r in rows if r["model"] == model and r["layout"] == "data 4")
            for row in rows:
                if row["model"] == model:
                    row["bytes_vs_data"] = row["total_MB/step/worker"] / data["total_MB/step/worker"]
    save("hybrid", vars(args), rows, ["model", "layout", "ring_MB/step/worker", "link_MB/step/worker",
                                      "total_MB/step/worker", "max_MB/step/worker", "bytes_vs_data", "step_s",
                                      "peak_MB_conv_or_data", "peak_MB_fc"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_hybrid() -> str:
    rows = rows_of("hybrid")
    return table(["model", "layout", "ring MB", "link MB", "total MB", "vs data", "busiest worker MB", "step",
                  "peak RSS conv (or data) / FC"],
                 [[r["model"], r["layout"], number(r["ring_MB/step/worker"]), number(r["link_MB/step/worker"]),
                   number(r["total_MB/step/worker"]), number(r["bytes_vs_data"]), number(r["max_MB/step/worker"]),
                   seconds(r["step_s"]),
                   f"{r['peak_MB_conv_or_data']:.0f}" + (f" / {r['peak_MB_fc']:.0f} MB" if r.get("peak_MB_fc") else " MB")]
                  for r in rows])


BLOCKS = (
    Block("hybrid", "Hybrid layout: bytes per worker per step, loopback", ("hybrid",),
          "data parallelism on the same 4 processes and global batch", render_hybrid,
          rerun="python bench/hybrid.py --steps 12"),
)


if __name__ == "__main__":
    main()
