"""Plain-text and markdown tables for the simulator's reports."""
from __future__ import annotations

from typing import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    """Columns padded to their widest cell (or a markdown table).

    Example::

        >>> print(format_table(["a", "bb"], [[1, 2.5]]))
        a  bb
        1  2.5
    """
    cells = [[str(c) for c in header]] + [[_cell(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
