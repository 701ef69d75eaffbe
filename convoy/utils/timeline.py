"""Where a worker's start-up time goes: wall-clock marks, written only when asked for.

With ``CONVOY_TIMELINE=<file>`` in the environment each :func:`mark` appends
one JSON line ``{"event", "t", "rank", "pid"}`` to the file (``t``: seconds
since the epoch, comparable across processes of one machine, as the emulated
hosts are); without it a mark is one dictionary lookup. The first mark of a
process also records when the process was created (``"exec"``, from
``/proc/self/stat``, to 10 ms), so the interpreter's own start and the imports
show. bench/train_through_failures.py ``--timeline`` reads the marks of every
life of a job to split a failure's downtime into its parts.

Example::

    >>> mark("process group")   # CONVOY_TIMELINE=/tmp/t.jsonl: {"event": "process group", "t": ..., ...}
"""
from __future__ import annotations

import json
import os
import time

ENV = "CONVOY_TIMELINE"
_started = False


def mark(event: str) -> None:
    """Record that ``event`` happened now (nothing unless ``CONVOY_TIMELINE`` names a file).

    Args:
        event: what happened, e.g. ``"imported"``, ``"first step"``.
    """
    path = os.environ.get(ENV)
    if not path:
        return
    global _started
    lines = []
    if not _started:
        _started = True
        created = _process_created()
        if created is not None:
            lines.append(_line("exec", created))
    lines.append(_line(event, time.time()))
    # One write of whole lines on an O_APPEND file: the processes' lines do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(lines).encode())
    finally:
        os.close(fd)


def _line(event: str, t: float) -> str:
    rank = os.environ.get("RANK")
    return json.dumps({"event": event, "t": t, "rank": None if rank is None else int(rank),
                       "pid": os.getpid()}) + "\n"


def _process_created() -> float | None:
    """When this process was created, on the wall clock (None off Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])   # /proc/stat's btime is whole seconds; this is to 10 ms
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))
