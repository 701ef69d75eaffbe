"""Threads of one rank sharing its CPU, run event by event.

A thread is a generator. It yields what it does next, ``("cpu", seconds)`` of
work (seconds at full speed) or ``("until", when)`` (``when()`` is the moment
it may go on, or None while nobody knows yet), and is sent the time it
resumes at. While two threads compute at once each runs at ``shared_rate`` of
its full speed: a rank short of cores (ranks sharing a machine) slows its
compute while its auxiliary thread compresses, instead of getting both done
in the time of one.
"""
from __future__ import annotations

from typing import Callable, Generator

Request = tuple[str, float] | tuple[str, Callable[[], float | None]]
Thread = Generator[Request, float, None]

_DONE = 1e-12   # seconds of work left that count as none (rounding)


def run(threads: list[Thread], shared_rate: float = 1.0) -> float:
    """Run ``threads`` to their ends from time 0; return when the last one ended.

    Example::

        >>> def worker(seconds):
        ...     yield ("cpu", seconds)
        >>> run([worker(1.0), worker(1.0)], shared_rate=0.5)
        2.0
    """
    if not 0 < shared_rate <= 1:
        raise ValueError(f"shared_rate must be in (0, 1], got {shared_rate}")
    now = 0.0
    live = {i: _resume(t, None) for i, t in enumerate(threads)}
    live = {i: r for i, r in live.items() if r is not None}
    while live:
        _settle(threads, live, now)
        if not live:
            break
        busy = [i for i, r in live.items() if r[0] == "cpu"]
        rate = shared_rate if len(busy) > 1 else 1.0
        wakes = [w for w in (r[1]() for r in live.values() if r[0] == "until") if w is not None]
        if not busy and not wakes:
            raise RuntimeError("every thread waits for another: the simulated step deadlocks")
        until = min([now + live[i][1] / rate for i in busy] + wakes)
        for i in busy:
            live[i] = ("cpu", live[i][1] - (until - now) * rate)
        now = until
    return now


def _settle(threads: list[Thread], live: dict[int, Request], now: float) -> None:
    """Resume every thread whose work is done or whose moment has come, until none is."""
    moved = True
    while moved:
        moved = False
        for i, (kind, arg) in list(live.items()):
            if kind == "cpu":
                go = arg <= _DONE
            else:
                when = arg()
                go = when is not None and when <= now
            if go:
                request = _resume(threads[i], now)
                if request is None:
                    del live[i]
                else:
                    live[i] = request
                moved = True


def _resume(thread: Thread, now: float | None) -> Request | None:
    try:
        return next(thread) if now is None else thread.send(now)
    except StopIteration:
        return None
