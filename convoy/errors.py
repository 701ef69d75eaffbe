"""Exceptions that the command line turns into one-line errors with exit status 2."""

# Every character str.splitlines() breaks at, and the other control characters.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127, 0x85)} | {10: "\\n", 13: "\\r", 9: "\\t",
                                                                   0x2028: "\\u2028", 0x2029: "\\u2029"}


# What gloo says when a peer's process or machine is gone mid-collective (a worker of
# ``torchrun --nnodes MIN:MAX`` then fails, and its agent re-forms the job on the survivors).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` (or an error it was raised from) is gloo losing a peer: not a bug, no traceback."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(text in str(seen) for text in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def one_line(message: str) -> str:
    """``message`` with control characters escaped, so a name the user typed (a path with a newline)
    cannot split the one line an error is printed on."""
    return message.translate(_CONTROL)


class UsageError(ValueError):
    """Bad input from the user: a value, a name, a file. Never a bug in convoy."""


class TrainingDiverged(RuntimeError):
    """The loss or the averaged gradient became non-finite: the run cannot go on.

    Not a bug in convoy either: the command line prints its message on one line,
    without a traceback, and exits with status 3.
    """

    def __init__(self, step: int, what: str, hint: str = ""):
        self.step, self.what = step, what
        super().__init__(f"{what} at step {step}" + (f"; {hint}" if hint else ""))


class StartupFailed(RuntimeError):
    """The job's processes did not find one another within the timeout: a setting (an address,
    an interface), not a bug in convoy. The command line prints the message, which names what
    to set, on one line without a traceback, and exits with status 1."""


class JobStopped(RuntimeError):
    """A stop signal ended the job after ``step`` steps, on every rank at the same step.

    Not a failure: the command line prints the message on one line and exits
    with status 128 + the signal's number, as a process ended by it would.

    Args:
        signum: the signal.
        who: who received it (``SIGTERM to rank 1``, ``SIGTERM to the launcher``).
        step: the steps every rank finished.
        committed: the step of the checkpoint to resume from (None: no --checkpoint-dir).
    """

    def __init__(self, signum: int, who: str, step: int, committed: int | None):
        self.signum, self.who, self.step, self.committed = signum, who, step, committed
        super().__init__(f"stopped by {who} at step {step}; {self.detail()}")

    def detail(self) -> str:
        """What became of the run: the checkpoint and how to go on."""
        if self.committed is None:
            return "no checkpoint (--checkpoint-dir not set): a new run starts at step 0"
        return f"checkpoint committed at step {self.committed}; resume with the same command"
