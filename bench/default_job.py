"""The README's main command, `convoy train` with no flags, timed and scored per seed.

    python bench/default_job.py [--seeds 0 1 2] [-- extra convoy train flags]

Runs the command as a user would (a fresh process per seed, wall clock includes
start-up and data loading) and writes bench/results/default_job.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save  # noqa: E402
from bench.figures import Block, percent, rows_of, seconds, table  # noqa: E402

TARGET = 0.97
BUDGET_S = 180.0


def run_seed(seed: int, extra: list[str]) -> dict:
    """Run ``convoy train --seed seed`` in a fresh process; its accuracy and wall-clock seconds."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "convoy", "train", "--seed", str(seed), "--no-progress",
                        "--out", out, *extra], check=True, capture_output=True)
        seconds = time.perf_counter() - start
        summary = json.loads((Path(out) / "summary.json").read_text())
    accuracy = summary["test_accuracy"]
    return {"seed": seed, "test_accuracy": accuracy, "seconds": seconds, "steps": summary.get("steps"),
            "meets_target": accuracy >= TARGET and seconds <= BUDGET_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("extra", nargs="*", help="extra convoy train flags (after --)")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.extra))
        print(rows[-1], flush=True)
    save("default_job", {**vars(args), "target": TARGET, "budget_s": BUDGET_S}, rows,
         ["seed", "test_accuracy", "seconds", "steps", "meets_target"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_default_job() -> str:
    rows = rows_of("default_job")
    return table(["seed", "test accuracy", "wall time (with start-up)", "steps", "97% within 180 s"],
                 [[str(r["seed"]), percent(r["test_accuracy"]), seconds(r["seconds"]), str(r["steps"]),
                   "yes" if r["meets_target"] else "no"] for r in rows])


BLOCKS = (
    Block("default_job", "The default job", ("default_job",), "the goal: 97% test accuracy within 180 s",
          render_default_job, rerun="python bench/default_job.py"),
)


if __name__ == "__main__":
    main()
