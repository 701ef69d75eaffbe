"""Processes that end with the one that started them, and signals turned into an orderly stop."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long a launcher (convoy's, like torchrun's agent) waits for its workers after a stop signal
# before it kills them.
STOP_GRACE_S = 30.0
# A worker's own bound on a stop, under the launcher's: a stop waits for the other ranks to agree on
# a step, and ranks that are gone or unreachable never answer; the worker then ends by itself, and
# says why, before the launcher's SIGKILL would end it without a word (or where no launcher waits).
WORKER_STOP_BOUND_S = STOP_GRACE_S - 5.0


class Stopped(Exception):
    """The process received one of STOP_SIGNALS; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOverdue(Stopped):
    """A stop signal was not carried out within ``bound_s``: the worker ends without its peers."""

    def __init__(self, signum: int, bound_s: float):
        super().__init__(signum)
        self.bound_s = bound_s


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux; elsewhere a no-op).

    Called in a child right after fork (or first thing in a worker under
    torchrun's agent), so a launcher killed with SIGKILL leaves no worker
    training on. If the parent ended before the call, the child ends now.

    Args:
        parent_pid: the pid of the parent the child must not outlive.
        sig: the signal the child receives when that parent ends.

    Example::

        >>> subprocess.Popen(argv, preexec_fn=lambda: die_with_parent(os.getpid()))  # doctest: +SKIP
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise Stopped instead of ending the process.

    Example::

        >>> with stop_on_signals():   # doctest: +SKIP
        ...     supervise(workers)     # a Stopped raised here lets the caller stop them first
    """
    def raise_stopped(signum: int, _frame: object) -> None:
        for sig in STOP_SIGNALS:   # once: a second signal must not interrupt the stopping
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopRequest:
    """A stop signal a worker received, acted on between training steps.

    Until :meth:`defer` is called (the training loop starts) a signal raises
    :class:`Stopped` at once: nothing is in flight that a stop should finish.
    From then on the handler only records the first signal; the loop passes
    :attr:`signum` to the per-step agreement, so every rank stops after the
    same step and can commit a checkpoint there. Later signals change nothing.
    Whatever the peers do, the process ends within ``bound_s`` of the first
    signal: ``overdue(StopOverdue)`` reports it, then the process exits with
    status 128 + the signal (a stop blocked in a collective with ranks that are
    gone, or in a start-up that waits for them, cannot hold it longer).

    Example::

        >>> stop = StopRequest.install()   # first thing in a worker
        >>> stop.defer()                   # the training loop begins
        >>> for step, batch in enumerate(batches):
        ...     agreed = guard.check(step, train(batch), stop=stop.signum)
    """

    __slots__ = ("signum", "deferring", "bound_s", "overdue")

    def __init__(self, bound_s: float | None = None, overdue: Callable[[StopOverdue], None] | None = None) -> None:
        self.signum = 0   # 0: no stop requested
        self.deferring = False
        self.bound_s, self.overdue = bound_s, overdue

    @classmethod
    def install(cls, bound_s: float = WORKER_STOP_BOUND_S,
                overdue: Callable[[StopOverdue], None] | None = None) -> "StopRequest":
        """A request that STOP_SIGNALS set, for the rest of this process's life.

        Args:
            bound_s: the process ends this long after the first signal at the latest.
            overdue: reports the overdue stop (its one line) before the process ends.
        """
        request = cls(bound_s, overdue)
        for sig in STOP_SIGNALS:
            signal.signal(sig, request._handle)
        return request

    def defer(self) -> None:
        """From now on, record stop signals instead of raising :class:`Stopped`."""
        self.deferring = True

    def _handle(self, signum: int, _frame: object) -> None:
        if not self.signum:
            self.signum = signum
            if self.bound_s is not None:
                # A thread, not an alarm: the main thread may be blocked in C++ where no handler runs.
                threading.Thread(target=self._end_overdue, args=(self.bound_s,), name="convoy-stop-bound",
                                 daemon=True).start()
        if not self.deferring:
            self.deferring = True   # raise once: the report of the stop must not be interrupted
            raise Stopped(signum)

    def _end_overdue(self, after_s: float) -> None:
        """In ``after_s`` seconds, end the process (the stop took too long)."""
        time.sleep(after_s)
        if self.overdue is not None:
            self.overdue(StopOverdue(self.signum, self.bound_s or 0.0))
        sys.stderr.flush()
        os._exit(128 + self.signum)
