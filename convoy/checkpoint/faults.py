"""Fault injection for crash tests: kill or slow the persister at chosen moments.

Two environment variables, read once per process:

- ``CONVOY_CHECKPOINT_KILL``: ``slot:G:I`` SIGKILLs the process after half of
  slot ``I`` of commit generation ``G`` is written; ``record:G`` after half of
  generation ``G``'s commit record is written; ``update:S`` after the payload of
  step ``S``'s differential record is written, before its magic. A crash test uses
  it to stop a writer exactly inside a layer, a commit record or a log record.
- ``CONVOY_CHECKPOINT_DELAY``: seconds to sleep at each of those half-way
  points, so kills sent at random times often land in the middle of a write.

Example::

    CONVOY_CHECKPOINT_KILL=record:3 python train.py   # dies while committing generation 3
"""
from __future__ import annotations

import os
import signal
import time

_KILL = os.environ.get("CONVOY_CHECKPOINT_KILL", "")
_DELAY = float(os.environ.get("CONVOY_CHECKPOINT_DELAY", "0") or 0)


def configure(kill: str = "", delay: float = 0.0) -> None:
    """Set the kill point and delay in-process (a forked test worker), as the variables would."""
    global _KILL, _DELAY
    _KILL, _DELAY = kill, delay


def armed() -> bool:
    """Whether a kill point or a delay is set (writers split their writes only then)."""
    return bool(_KILL or _DELAY)


def halfway(kind: str, generation: int, index: int = 0) -> None:
    """Called by the store half-way through writing a slot or a commit record (``generation``
    is the step for a differential record)."""
    if _DELAY:
        time.sleep(_DELAY)
    if _KILL and _KILL == (f"slot:{generation}:{index}" if kind == "slot" else f"{kind}:{generation}"):
        os.kill(os.getpid(), signal.SIGKILL)
