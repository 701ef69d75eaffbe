"""Accuracy after one fixed wall-time budget, from the suite's result files.

    python bench/accuracy_at_budget.py bench/results/suite_full_resnet18_1gbit_{a,b,c}.json --name resnet18_1gbit

The suite stops each run once it reaches the target, so the accuracy at each
run's end is taken at a different time. This compares every strategy of a
setting (model and link rate, gathered from all the files given) at one
budget. By default the budget is the setting's earliest time to the target:
every other run was still going then, so its curve says where it stood.
A run that stopped at the target before a longer --budget-s is reported at
its stop, marked so.

Writes bench/results/accuracy_at_budget_<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save  # noqa: E402
from bench.figures import Block, percent, rows_of, seconds, table as markdown_table  # noqa: E402


def accuracy_at(curve: Sequence[Sequence[float]], budget_s: float) -> float | None:
    """The test accuracy of the last evaluation at or before ``budget_s``; None before the first."""
    reached = [accuracy for time_s, accuracy in curve if time_s <= budget_s]
    return reached[-1] if reached else None


def budget_rows(rows: Sequence[dict], budget_s: float | None = None) -> list[dict]:
    """One row per strategy of each (model, rate): its accuracy at the setting's budget.

    Args:
        rows: the suite's rows (``strategy``, ``model``, ``rate``, ``curve``,
            ``time_to_target_s``); rows without a curve (failed runs) are skipped.
        budget_s: the budget in seconds; None takes each setting's earliest
            time to the target.

    Raises:
        ValueError: when no budget is given and no run of a setting reached the target.
    """
    settings: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("curve"):
            settings.setdefault((row["model"], row["rate"]), []).append(row)
    out = []
    for (model, rate), runs in settings.items():
        budget = budget_s if budget_s is not None else _earliest_hit(runs, model, rate)
        at_budget = [(accuracy_at(run["curve"], budget), run) for run in runs]
        for accuracy, run in sorted(at_budget, key=lambda pair: -(pair[0] or 0.0)):
            stopped = run["time_to_target_s"] is not None and run["curve"][-1][0] < budget
            out.append({"model": model, "rate": rate, "strategy": run["strategy"], "budget_s": budget,
                        "accuracy_at_budget": accuracy,
                        "note": "stopped at the target before the budget" if stopped else ""})
    return out


def _earliest_hit(runs: Sequence[dict], model: str, rate: str) -> float:
    hits = [r["time_to_target_s"] for r in runs if r.get("time_to_target_s") is not None]
    if not hits:
        raise ValueError(f"no run of {model} at {rate} reached the target; give --budget-s")
    return min(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="suite result files (suite_*.json)")
    parser.add_argument("--budget-s", type=float, help="the budget in seconds (default: the earliest hit)")
    parser.add_argument("--name", required=True, help="suffix of the result files' names")
    args = parser.parse_args()
    rows = [row for path in args.files for row in json.loads(path.read_text())["rows"]]
    try:
        table = budget_rows(rows, args.budget_s)
    except ValueError as exc:
        parser.exit(2, f"accuracy_at_budget: error: {exc}\n")
    save(f"accuracy_at_budget_{args.name}", {"files": [p.name for p in args.files], "budget_s": args.budget_s}, table,
         ["model", "rate", "strategy", "budget_s", "accuracy_at_budget", "note"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

SETTINGS = tuple((model, rate) for model in ("vgg_fc", "resnet18") for rate in ("100mbit", "1gbit"))


def render_accuracy_at_budget() -> str:
    cells = []
    for model, rate in SETTINGS:
        rows = rows_of(f"accuracy_at_budget_{model}_{rate}")
        if rows:
            ranked = sorted(rows, key=lambda r: -(r["accuracy_at_budget"] or 0))
            cells.append([f"{model}, {rate}", seconds(rows[0]["budget_s"]),
                          ", ".join(f"{r['strategy']} {percent(r['accuracy_at_budget'], 'not evaluated yet')}"
                                    for r in ranked)])
    return markdown_table(["setting", "budget (the first run to 97%)", "accuracy at the budget"], cells)


BLOCKS = (
    Block("accuracy_at_budget", "Every strategy at one wall-time budget",
          tuple(f"accuracy_at_budget_{model}_{rate}" for model, rate in SETTINGS),
          "the first run of the setting to reach 97%", render_accuracy_at_budget,
          rerun="python bench/accuracy_at_budget.py FILES --name NAME"),
)


if __name__ == "__main__":
    main()
