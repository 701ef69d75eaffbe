"""Processes that end with the one that started them, and signals turned into an orderly stop."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """The process received one of STOP_SIGNALS; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
    same step and can commit a checkpoint there. Later signals change nothing:
    the launcher (or torchrun's agent) sends SIGKILL if the stop takes too long.

    Example::

        >>> stop = StopRequest.install()   # first thing in a worker
        >>> stop.defer()                   # the training loop begins
        >>> for step, batch in enumerate(batches):
        ...     agreed = guard.check(step, train(batch), stop=stop.signum)
    """

    __slots__ = ("signum", "deferring")

    def __init__(self) -> None:
        self.signum = 0   # 0: no stop requested
        self.deferring = False

    @classmethod
    def install(cls) -> "StopRequest":
        """A request that STOP_SIGNALS set, for the rest of this process's life."""
        request = cls()
        for sig in STOP_SIGNALS:
            signal.signal(sig, request._handle)
        return request

    def defer(self) -> None:
        """From now on, record stop signals instead of raising :class:`Stopped`."""
        self.deferring = True

    def _handle(self, signum: int, _frame: object) -> None:
        if not self.signum:
            self.signum = signum
        if not self.deferring:
            self.deferring = True   # raise once: the report of the stop must not be interrupted
            raise Stopped(signum)
