"""``convoy plot``: turn one rank's metrics file of a run folder into PNG charts.

Writes ``loss.png``, ``accuracy.png``, ``bytes.png`` and ``step_time.png``.
matplotlib is imported inside :func:`plot_run`, so importing this module is cheap.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from convoy.errors import UsageError
from convoy.train.metrics import metrics_path

PLOT_FILES = ("loss.png", "accuracy.png", "bytes.png", "step_time.png")

_DESCRIPTION = """\
Plot the metrics of one rank of a training run.

Reads RUN_DIR/metrics-rank{R}.jsonl and writes four PNG files to the
output folder (RUN_DIR unless --out is given):

  loss.png       training loss against step and against wall time,
                 with the test loss of each evaluation overlaid
  accuracy.png   test accuracy (%) against step and against wall time,
                 with the training accuracy as a faint line
  bytes.png      megabytes sent (dashed) and received (wide) per step
  step_time.png  time per step split into compute and waiting on
                 communication, with the means; the scale ends near the
                 99th percentile, so a slow first step does not set it

Existing files of the same names are overwritten. The path of each file
written is printed, one per line.
"""


def add_parser(subparsers: Any) -> None:
    """Register the ``plot`` sub-command on an argparse subparsers object."""
    p = subparsers.add_parser(
        "plot",
        help="write PNG charts (loss, accuracy, bytes, step time) of a run folder",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                   help="run folder written by training (holds metrics-rank{R}.jsonl)")
    p.add_argument("--out", metavar="DIR", type=Path, default=None,
                   help="folder to write the PNG files to, created if missing (default: RUN_DIR)")
    p.add_argument("--rank", metavar="R", type=int, default=0,
                   help="whose metrics to plot: reads metrics-rank{R}.jsonl (default: 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for path in plot_run(Path(args.run_dir), getattr(args, "out", None), getattr(args, "rank", 0)):
        print(path)
    return 0


def _existing_ranks(run_dir: Path) -> list[int]:
    ranks = []
    for p in run_dir.glob("metrics-rank*.jsonl"):
        m = re.fullmatch(r"metrics-rank(\d+)\.jsonl", p.name)
        if m:
            ranks.append(int(m.group(1)))
    return sorted(ranks)


def _load(run_dir: Path, rank: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read and check one rank's records; returns (step records, eval records), sorted by step."""
    if not run_dir.exists():
        raise UsageError(f"run folder {run_dir} does not exist")
    if not run_dir.is_dir():
        raise UsageError(f"run folder {run_dir} is not a directory")
    path = metrics_path(run_dir, rank)
    if not path.is_file():
        ranks = _existing_ranks(run_dir)
        if ranks:
            have = "it has metrics for rank(s) " + ", ".join(str(r) for r in ranks)
        else:
            have = "it has no metrics-rank*.jsonl files at all"
        raise UsageError(f"no {path.name} in {run_dir}; {have}")

    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise UsageError(f"{path}: line {lineno} is not a JSON object")
            kind = rec.get("kind")
            try:
                if kind == "step":
                    steps.append({k: float(rec[k]) for k in
                                  ("step", "time", "loss", "train_accuracy", "wait_s",
                                   "compute_s", "bytes_sent", "bytes_received")})
                elif kind == "eval":
                    evals.append({k: float(rec[k]) for k in
                                  ("step", "time", "test_accuracy", "test_loss")})
            except KeyError as e:
                raise UsageError(f"{path}: line {lineno}: {kind} record lacks field {e.args[0]!r}") from None
            except (TypeError, ValueError):
                raise UsageError(f"{path}: line {lineno}: {kind} record has a non-numeric field") from None
    if not steps:
        raise UsageError(f"{path} has no step records")
    steps.sort(key=lambda r: r["step"])
    evals.sort(key=lambda r: r["step"])
    return steps, evals


def robust_top(values: list[float], percentile: float = 99.0) -> float:
    """The ``percentile``-th of ``values``, never interpolated towards an outlier above it.

    The step-time chart's scale: the first steps (warm-up, tracing) can take
    many times longer than the rest and would otherwise flatten every other step.

    Example::

        >>> robust_top([5.0] + [0.1] * 99)
        0.1
    """
    import numpy as np

    return float(np.percentile(values, percentile, method="lower")) if values else 0.0


def plot_run(run_dir: Path, out_dir: Path | None = None, rank: int = 0) -> list[Path]:
    """Write the four PNG charts of ``rank``'s metrics; returns their paths."""
    run_dir = Path(run_dir)
    steps, evals = _load(run_dir, rank)
    out_dir = run_dir if out_dir is None else Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"output folder {out_dir} is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def col(records: list[dict[str, Any]], key: str) -> list[float]:
        return [r[key] for r in records]

    s_step, s_time = col(steps, "step"), col(steps, "time")
    e_step, e_time = col(evals, "step"), col(evals, "time")
    title = f"{run_dir.name} (rank {rank})"
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    # 1. loss
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, sx, ex, xlabel in ((axes[0], s_step, e_step, "step"),
                               (axes[1], s_time, e_time, "wall time (s)")):
        ax.plot(sx, col(steps, "loss"), lw=1, label="training loss")
        if evals:
            ax.plot(ex, col(evals, "test_loss"), "o--", color="tab:red", label="test loss")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("loss")
    save(fig, "loss.png")

    # 2. accuracy
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    train_acc = [100 * a for a in col(steps, "train_accuracy")]
    test_acc = [100 * a for a in col(evals, "test_accuracy")]
    for ax, sx, ex, xlabel in ((axes[0], s_step, e_step, "step"),
                               (axes[1], s_time, e_time, "wall time (s)")):
        ax.plot(sx, train_acc, lw=1, alpha=0.35, color="tab:gray", label="training accuracy")
        if evals:
            ax.plot(ex, test_acc, "o-", color="tab:green", label="test accuracy")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("accuracy (%)")
    save(fig, "accuracy.png")

    # 3. bytes: often equal (a ring all-reduce sends what it receives), so the
    # sent line is dashed with markers on top of a wide, faint received line.
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(s_step, [b / 1e6 for b in col(steps, "bytes_received")], lw=4, alpha=0.4, color="tab:orange",
            label="received")
    ax.plot(s_step, [b / 1e6 for b in col(steps, "bytes_sent")], "--", lw=1.2, color="tab:blue",
            marker="o", markersize=3, markevery=max(1, len(s_step) // 40), label="sent", zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("MB per step")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "bytes.png")

    # 4. step time breakdown
    compute, wait = col(steps, "compute_s"), col(steps, "wait_s")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(s_step, compute, wait, labels=["compute", "waiting on communication"],
                 colors=["tab:blue", "tab:orange"], alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    totals = [c + w for c, w in zip(compute, wait)]
    top = robust_top(totals) * 1.35   # head room for the legend and the text box
    clipped = sum(t > top for t in totals)
    if top > 0:
        ax.set_ylim(0, top)
    n = len(steps)
    mean_c, mean_w = sum(compute) / n, sum(wait) / n
    total = mean_c + mean_w
    share = f" ({100 * mean_w / total:.0f}% of step)" if total > 0 else ""
    above = f"\n{clipped} step(s) above the chart, the slowest {max(totals) * 1000:.0f} ms" if clipped else ""
    ax.text(0.02, 0.97,
            f"mean compute: {mean_c * 1000:.1f} ms\n"
            f"mean waiting on communication: {mean_w * 1000:.1f} ms{share}{above}",
            transform=ax.transAxes, va="top", ha="left", fontsize=9,
            bbox=dict(boxstyle="round", facecolor="white", alpha=0.85))
    save(fig, "step_time.png")

    return written
