"""Grouped bar charts for the compression benchmarks (PNG next to the JSON)."""
from __future__ import annotations

from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import RESULTS  # noqa: E402


def bars(name: str, rows: Sequence[dict[str, Any]], group: str, series: Sequence[str], ylabel: str,
         title: str, log: bool = False) -> None:
    """One group of bars per distinct ``row[group]``, one bar per column in ``series``; saves results/<name>.png."""
    groups = list(dict.fromkeys(str(r[group]) for r in rows))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(groups) * max(1.0, len(series) / 2)), 4.5))
    for i, column in enumerate(series):
        values = [next((r[column] for r in rows if str(r[group]) == g and r.get(column) is not None), 0)
                  for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=column)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups, rotation=30,
                  ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(fig)
