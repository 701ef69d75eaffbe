"""Exceptions that the command line turns into one-line errors with exit status 2."""


class UsageError(ValueError):
    """Bad input from the user: a value, a name, a file. Never a bug in convoy."""
