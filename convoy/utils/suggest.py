"""Suggestions for mistyped names: flags, choices, config keys."""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the choice closest to ``word``, or ``""`` when none is close.

    Appended to a one-line error, it names what the user probably meant.

    Example::

        >>> did_you_mean("--modle", ["--model", "--dataset"])
        '; did you mean --model?'
    """
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
