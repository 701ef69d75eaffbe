"""The one wait/poll helper: block on a condition, look up every POLL_S to notice a failed peer thread.

A thread that waits for another thread's progress must not wait for ever when
that thread died; each wait wakes up every ``POLL_S`` seconds to check.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

POLL_S = 0.5  # how often a blocked thread looks up from a wait to notice a failure


def wait_until(cond: threading.Condition, predicate: Callable[[], bool],
               check: Callable[[], None] | None = None) -> float:
    """Block until ``predicate()`` (evaluated holding ``cond``); return the seconds waited.

    ``check`` runs before every wait and once more at the end; it raises to
    abandon the wait (a failed helper thread, a dead peer).

    Example::

        >>> waited = wait_until(cond, lambda: done[0], check=raise_if_failed)
    """
    start = time.perf_counter()
    with cond:
        while not predicate():
            if check is not None:
                check()
            cond.wait(POLL_S)
    if check is not None:
        check()
    return time.perf_counter() - start


class Waiter:
    """A condition variable plus the first failure of any helper thread.

    Helper threads call ``fail``; waiting threads raise it through ``raise_error``
    (by default ``RuntimeError(message)`` chained to the cause) instead of
    waiting for ever.

    Args:
        raise_error: ``(message, cause) -> None``, raises the failure in a waiting thread.

    Example::

        >>> waiter = Waiter()
        >>> threading.Thread(target=lambda: waiter.fail("the sender died", OSError("reset"))).start()
        >>> waiter.wait_for(lambda: False)   # raises RuntimeError: the sender died: reset
    """

    def __init__(self, raise_error: Callable[[str, BaseException], None] | None = None):
        self.cond = threading.Condition()
        self.error: str | None = None
        self.cause: BaseException | None = None
        self._raise_error = raise_error or _raise_runtime_error

    def fail(self, message: str, exc: BaseException) -> None:
        """Record the first failure (later ones are consequences) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error, self.cause = f"{message}: {exc}" if message else str(exc), exc
            self.cond.notify_all()

    def failure_within(self, timeout_s: float) -> str | None:
        """The recorded failure's message, waiting up to ``timeout_s`` for one; None if none came."""
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None, timeout=timeout_s)
            return self.error

    def raise_if_failed(self) -> None:
        if self.error is not None:
            self._raise_error(self.error, self.cause)

    def wait_for(self, predicate: Callable[[], bool], extra_check: Callable[[], None] | None = None) -> float:
        """Block until ``predicate()``; return the seconds waited; raise a recorded failure."""
        def check() -> None:
            self.raise_if_failed()
            if extra_check is not None:
                extra_check()
        return wait_until(self.cond, predicate, check)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


def _raise_runtime_error(message: str, cause: BaseException | None) -> None:
    raise RuntimeError(message) from cause
