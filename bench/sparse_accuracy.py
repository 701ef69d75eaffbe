"""Issue 18's loopback acceptance check: compressed vgg_fc within a point of dense, >= 20x fewer bytes.

    python -m bench.sparse_accuracy [--steps 300] [--parallel 1] [--extra NAME="FLAGS"]

Runs the issue's command with each compressor at its
defaults (no other flags)::

    convoy train --model vgg_fc --nproc 2 --batch-size 16 --seed 5 --steps 300 --compress none
    convoy train ... --compress blocktopk --block-fraction 0.01
    convoy train ... --compress powersgd

and reads each run's summary.json: the final test accuracy and the bytes a
worker sent over the whole run (warm-up included). Accuracy is deterministic
(seeded, gloo sums in a fixed order), so the machine's load changes only the
times. ``--extra NAME="FLAGS"`` adds a run with more flags (a setting tried
while choosing the defaults). Writes bench/results/sparse_accuracy.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save  # noqa: E402

COMMAND = ["--model", "vgg_fc", "--nproc", "2", "--batch-size", "16", "--seed", "5", "--no-progress"]
STRATEGIES = {
    "none": ["--compress", "none"],
    "blocktopk 1%": ["--compress", "blocktopk", "--block-fraction", "0.01"],
    "powersgd": ["--compress", "powersgd"],
}
# The thresholds.
MIN_RATIO, MAX_DROP_POINTS = 20.0, 1.0


def train(flags: list[str], steps: int) -> dict:
    """Final test accuracy (%), MB one worker sent, and wall seconds of one loopback run of vgg_fc."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "convoy", "train", *COMMAND, "--steps", str(steps), "--out", out, *flags]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=os.environ.copy())
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"test_accuracy_%": 100 * summary["test_accuracy"], "MB_sent": summary["bytes_sent_per_worker"] / 1e6,
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (accuracy does not depend on it)")
    parser.add_argument("--extra", action="append", default=[], metavar='NAME="FLAGS"',
                        help="another run: a name and its convoy train flags")
    args = parser.parse_args()
    runs = dict(STRATEGIES)
    for extra in args.extra:
        name, _, flags = extra.partition("=")
        runs[name] = shlex.split(flags)
    with ThreadPoolExecutor(args.parallel) as pool:
        results = dict(zip(runs, pool.map(lambda flags: train(flags, args.steps), runs.values())))
    dense = results["none"]
    rows = []
    for name, got in results.items():
        ratio = dense["MB_sent"] / got["MB_sent"]
        drop = dense["test_accuracy_%"] - got["test_accuracy_%"]
        rows.append({"strategy": name, "flags": " ".join(runs[name]), **got, "ratio_to_dense": ratio,
                     "points_below_dense": drop,
                     "passes": None if "none" in runs[name] else ratio >= MIN_RATIO and drop <= MAX_DROP_POINTS})
    save("sparse_accuracy", {"steps": args.steps, "parallel": args.parallel,
                             "command": "convoy train " + " ".join(COMMAND),
                             "thresholds": {"min_ratio": MIN_RATIO, "max_drop_points": MAX_DROP_POINTS}},
         rows, ["strategy", "flags", "test_accuracy_%", "MB_sent", "ratio_to_dense", "points_below_dense",
                "passes", "wall_s"])


if __name__ == "__main__":
    main()
