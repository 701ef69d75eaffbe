"""Shared plumbing of the benchmarks: spawning gloo workers, tables, result files."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from convoy.utils.spawn import run_in_processes as spawn  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    """Where, when and how a result was measured: the command is recorded as it ran, so the
    pages that show the result print it from here (it cannot drift from what ran)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line()}


def command_line() -> str:
    """This process's command as a user types it from the repository root: ``python bench/x.py ARGS``."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])


def timed_round(step: Callable[[], Any], finish: Callable[[], Any], steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds (every thread) per step of ``steps`` calls of ``step`` and the
    drain (``finish``), all ranks of the default group started together by a barrier."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    finish()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def save(name: str, settings: dict[str, Any], rows: list[dict[str, Any]], columns: Sequence[str]) -> Path:
    """Write results/<name>.json and results/<name>.md; print the table."""
    RESULTS.mkdir(exist_ok=True)
    text = table(rows, columns)
    print(text)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "settings": settings, "rows": rows}, indent=2))
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\nsettings: `{json.dumps(settings)}`\n\n{text}\n")
    return path
