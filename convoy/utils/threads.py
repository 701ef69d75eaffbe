"""Scheduling of convoy's helper threads."""
from __future__ import annotations

import os
import threading

# A checkpoint persister only needs to keep up: it yields to every thread that trains.
PERSISTER_THREAD_NICE = 19


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread; elsewhere a no-op).

    Lowering a priority needs no privilege; the thread cannot raise it back.

    Example::

        >>> threading.Thread(target=lambda: (lower_priority(19), persist())).start()
    """
    if nice <= 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, current + nice))
    except (AttributeError, OSError):   # no per-thread priorities on this platform
        pass
