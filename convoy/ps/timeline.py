"""A rank's timeline of a few steps, as Chrome trace events (chrome://tracing, Perfetto).

Spans are recorded with wall-clock microseconds so that the ranks' files line
up when merged (``convoy trace``). Only steps ``first_step .. first_step +
steps - 1`` are kept, so a long run writes a small file.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class Timeline:
    """Collects spans and instants of one rank on named tracks.

    Args:
        rank: this process's rank (the trace's process id).
        role: ``server`` or ``worker`` (shown as the process name).
        steps: how many steps to keep.
        first_step: the first step kept (step 0 pays one-off costs).

    Example::

        >>> timeline = Timeline(rank=1, role="worker", steps=2)
        >>> timeline.span("conv1", "compute", "forward", start=t0, end=t1, step=1)
        >>> timeline.save(Path("run"))   # run/trace-rank1.json
    """

    def __init__(self, rank: int, role: str, steps: int, first_step: int = 1):
        self.rank, self.role = rank, role
        self.first_step, self.last_step = first_step, first_step + steps - 1
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()

    def wants(self, step: int) -> bool:
        return self.first_step <= step <= self.last_step

    def span(self, name: str, cat: str, track: str, start: float, end: float, step: int, **args: Any) -> None:
        """A span from ``start`` to ``end`` (``time.time()`` seconds) if ``step`` is kept."""
        if self.wants(step):
            self._add({"name": name, "cat": cat, "ph": "X", "ts": start * 1e6,
                       "dur": max(end - start, 0.0) * 1e6, "args": {"step": step, **args}}, track)

    def instant(self, name: str, cat: str, track: str, at: float, step: int, **args: Any) -> None:
        if self.wants(step):
            self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": at * 1e6,
                       "args": {"step": step, **args}}, track)

    def _add(self, event: dict[str, Any], track: str) -> None:
        with self._lock:
            tid = self._tracks.setdefault(track, len(self._tracks))
            self._events.append({**event, "pid": self.rank, "tid": tid})

    def save(self, run_dir: Path) -> Path:
        """Write ``trace-rank<R>.json`` into ``run_dir``, with process and track names."""
        with self._lock:
            names = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                      "args": {"name": f"rank {self.rank} ({self.role})"}},
                     {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                      "args": {"sort_index": self.rank}}]
            names += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": track}}
                      for track, tid in self._tracks.items()]
            events = names + list(self._events)
        path = Path(run_dir, f"trace-rank{self.rank}.json")
        path.write_text(json.dumps({"traceEvents": events}))
        return path
