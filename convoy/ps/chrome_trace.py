"""Merging the ranks' timelines into one Chrome trace (chrome://tracing, ui.perfetto.dev)."""
from __future__ import annotations

import json
from pathlib import Path

from convoy.errors import UsageError

TRACE_FILE = "trace.json"


def merge_traces(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Combine ``trace-rank*.json`` of ``run_dir`` into one trace whose clock starts at 0.

    Example::

        >>> merge_traces("runs/ps")   # runs/ps/trace.json
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a folder")
    files = sorted(run_dir.glob("trace-rank*.json"), key=lambda p: int(p.stem.removeprefix("trace-rank") or 0))
    if not files:
        raise UsageError(f"{run_dir} holds no trace-rank*.json; train with --sync ps --trace")
    events = []
    for path in files:
        try:
            events += json.loads(path.read_text())["traceEvents"]
        except (ValueError, KeyError) as exc:
            raise UsageError(f"{path} is not a convoy trace: {exc}") from None
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0.0
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 1)
        if "dur" in event:
            event["dur"] = round(event["dur"], 1)
    path = Path(out) if out is not None else run_dir / TRACE_FILE
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def summarize(path: Path) -> dict[str, int]:
    """Event counts per category of a merged trace (what ``convoy trace`` prints)."""
    counts: dict[str, int] = {}
    for event in json.loads(Path(path).read_text())["traceEvents"]:
        if event.get("ph") in ("X", "i"):
            counts[event["cat"]] = counts.get(event["cat"], 0) + 1
    return counts
