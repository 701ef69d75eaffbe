"""Shared waiting and failure handling of the server and worker engines."""
from __future__ import annotations

import threading
import time
from typing import Callable

_POLL_S = 0.5  # how often a blocked thread looks up to notice a failed peer


class PSError(RuntimeError):
    """Parameter-server training cannot go on: a peer died or a transfer failed."""


class Progress:
    """A condition variable plus the first failure of any helper thread.

    Helper threads call ``fail``; the main thread's ``wait_for`` raises it as a
    PSError instead of waiting for ever.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: str | None = None
        self.cause: BaseException | None = None

    def fail(self, message: str, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error, self.cause = f"{message}: {exc}", exc
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise PSError(self.error) from self.cause

    def wait_for(self, predicate: Callable[[], bool], extra_check: Callable[[], None] | None = None) -> float:
        """Block until ``predicate()`` (evaluated under the lock); return the seconds waited."""
        start = time.perf_counter()
        with self.cond:
            while not predicate():
                self.raise_if_failed()
                if extra_check is not None:
                    extra_check()
                self.cond.wait(_POLL_S)
        self.raise_if_failed()
        return time.perf_counter() - start

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()


class Traffic:
    """Bytes on the wire, and the worker count an all-reduce would average over (for metrics)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0

    def count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def traffic(self) -> tuple[int, int]:
        with self._lock:
            return self.bytes_sent, self.bytes_received

    def step_metrics(self, step: int) -> dict:
        return {}
