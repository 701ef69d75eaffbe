"""argparse that reports bad input as a UsageError (one line, exit 2) instead of exiting,
and suggests the flag or choice the user probably meant."""
from __future__ import annotations

import argparse
import re
from typing import Sequence

from convoy.errors import UsageError
from convoy.utils.suggest import did_you_mean

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        choice = _INVALID_CHOICE.search(message)
        if choice:  # a mistyped command; Python < 3.12 quotes the listed choices, later ones do not
            choices = [word.strip("'") for word in choice.group(2).split(", ")]
            message += did_you_mean(choice.group(1), choices)
        raise UsageError(f"{self.prog}: {message}")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Parse, and reject unknown flags here, where this (sub)command's own flags are known.

        The top-level parser would otherwise report a subcommand's leftovers
        without knowing which flags that subcommand has.
        """
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(self._unrecognized(extras))
        return parsed, extras

    def _unrecognized(self, extras: list[str]) -> str:
        message = f"unrecognized arguments: {' '.join(extras)}"
        flags = [word.partition("=")[0] for word in extras if word.startswith("-")]
        if not flags:
            return message
        known = [option for action in self._actions for option in action.option_strings]
        return message + did_you_mean(flags[0], known)
