"""argparse that reports bad input as a UsageError (one line, exit 2) instead of exiting."""
from __future__ import annotations

import argparse

from convoy.errors import UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")
