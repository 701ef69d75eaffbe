"""Exceptions that the command line turns into one-line errors with exit status 2."""


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
