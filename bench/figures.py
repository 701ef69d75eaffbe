"""What a benchmark's renderers are made of: its result files read back, cells formatted, the Block record.

Each benchmark module that writes bench/results/*.json also says how its results
appear in the documentation: a ``BLOCKS`` tuple of :class:`Block`, each naming a
``<!-- bench:NAME -->`` marker of the pages, the result files it reads and a
function returning the markdown table. bench/make_readme.py collects the blocks
of the modules it lists and writes them into the pages; nothing else names them.

Example::

    from bench.figures import Block, percent, rows_of, table

    def render_default_job() -> str:
        return table(["seed", "test accuracy"],
                     [[str(r["seed"]), percent(r["test_accuracy"])] for r in rows_of("default_job")])

    BLOCKS = (Block("default_job", "The default job", ("default_job",), "the goal: 97% within 180 s",
                    render_default_job, rerun="python bench/default_job.py"),)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"

Row = dict[str, Any]


@dataclass(frozen=True)
class Block:
    """One generated table of the pages.

    Args:
        name: the marker's NAME (``<!-- bench:NAME -->``), unique over every benchmark.
        title: its heading in bench/README.md.
        sources: the result files it reads (bench/results/<source>.json), the first one named under it.
        peer: what the figures are compared with.
        render: returns the markdown between the markers (the table; the command and the
            machine line are added by make_readme from the result files).
        rerun: how to measure it again, shown only for result files that did not record
            the command they ran (measured before bench/common.py recorded it).
        emulated: it builds network namespaces: root, one run at a time.
    """
    name: str
    title: str
    sources: tuple[str, ...]
    peer: str
    render: Callable[[], str]
    rerun: str
    emulated: bool = False


# Reading result files -----------------------------------------------------------------------

def load(name: str) -> dict[str, Any] | None:
    """bench/results/<name>.json, or None when that benchmark has not been run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def loaded(*names: str) -> list[dict[str, Any]]:
    """The result files of ``names`` that exist, in order."""
    return [data for name in names if (data := load(name))]


def rows_of(*names: str) -> list[Row]:
    """Every row of the result files of ``names`` that exist, in order."""
    return [row for data in loaded(*names) for row in data.get("rows", [])]


# Formatting cells -----------------------------------------------------------------------------

def seconds(value: Any, missing: str = "-") -> str:
    if value is None or value == "":
        return missing
    if value < 0.1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.0f} s" if value >= 100 else f"{value:.3g} s"


def percent(value: Any, missing: str = "-") -> str:
    return missing if value is None or value == "" else f"{100 * value:.1f}%"


def number(value: Any, missing: str = "-") -> str:
    if value is None or value == "":
        return missing
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def times(value: Any, missing: str = "-") -> str:
    return missing if value is None or value == "" else f"{value:.2f}x"


def table(header: Sequence[str], cells: Iterable[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)
