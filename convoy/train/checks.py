"""The checks every setting of ``convoy train`` goes through, and the limits they hold it to.

Each check raises :class:`~convoy.errors.UsageError` with one line naming
the flag (``--batch-size must be >= 1, got 0``); none changes anything.

Example::

    >>> at_least("batch_size", 0, 1)
    Traceback (most recent call last):
    convoy.errors.UsageError: --batch-size must be >= 1, got 0
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from convoy.errors import UsageError
from convoy.utils.suggest import did_you_mean

# Ceilings of the integer settings. A local run's processes share one machine:
# more than MAX_NPROC of them, or more torch threads than THREADS_PER_CORE per
# core, only thrash (and very large values exhaust the process limit).
MAX_NPROC = 256
THREADS_PER_CORE = 4
MAX_BATCH_SIZE = 1 << 20
MAX_SAMPLE_ELEMENTS = 1 << 24    # 64 MB of float32 per image
MAX_SEED = 2**63 - 1          # torch.manual_seed takes a signed 64-bit integer
MAX_COUNT = 10**9             # steps, epochs and the other counts
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# What --model, --dataset and --optimizer accept besides their built-in names.
IMPORT_FORMS = ("file.py:factory", "package.module:factory")


def max_local_processes() -> int:
    """The most worker processes ``--nproc`` may start: MAX_NPROC, or fewer under the process limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    except (ImportError, ValueError, OSError):
        return MAX_NPROC
    # Each worker runs gloo and torch threads, and the user's own processes count too.
    return MAX_NPROC if soft == resource.RLIM_INFINITY else max(1, min(MAX_NPROC, soft // 16))


def max_threads() -> int:
    """The most torch threads per worker: THREADS_PER_CORE per core of this machine."""
    return (os.cpu_count() or 1) * THREADS_PER_CORE


def flag(name: str) -> str:
    """The flag of the setting ``name``: ``clip_grad_norm`` -> ``--clip-grad-norm``."""
    return "--" + name.replace("_", "-")


def check_fields(section: Any) -> None:
    """What the field table says of every section's values: counts up to MAX_COUNT, finite numbers,
    paths not empty; a value past them would hang, crash or exhaust the machine."""
    for f in dataclasses.fields(section):
        name, value = f.metadata["flag"] or f.name, getattr(section, f.name)
        if f.metadata["count"] and value is not None and value > MAX_COUNT:
            raise UsageError(f"{flag(name)} must be <= {MAX_COUNT}, got {value}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(name)} must be a finite number, got {value}")
        if f.metadata["path"] and isinstance(value, str) and not value.strip():
            raise UsageError(f"{flag(name)} must not be empty; give a path")


def check_name(name: str, value: str, choices: tuple[str, ...]) -> None:
    """A built-in name; an import path (``a:b``) is resolved later, where the user's modules are imported."""
    if ":" not in value:
        one_of(name, value, choices + IMPORT_FORMS)


def within(name: str, value: int, low: int, high: int) -> None:
    at_least(name, value, low)
    if value > high:
        raise UsageError(f"{flag(name)} must be <= {high}, got {value}")


def count_or_auto(name: str, value: Any) -> int | str:
    """``--checkpoint-every``, ``--checkpoint-full-every``: a whole number in [1, MAX_COUNT], or ``"auto"``."""
    if value == "auto":
        return value
    try:
        count = int(value) if not isinstance(value, (bool, float)) else None
    except ValueError:
        count = None
    if count is None or str(value).strip() not in (str(count), f"+{count}") or not 1 <= count <= MAX_COUNT:
        raise UsageError(f"{flag(name)} must be a whole number from 1 to {MAX_COUNT}, or auto; got {value!r}")
    return count


def at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise UsageError(f"{flag(name)} must be >= {low}, got {value}")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise UsageError(f"{flag(name)} must be > 0, got {value}")


def fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise UsageError(f"{flag(name)} must be in (0, 1], got {value}")


def one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {flag(name)} {value!r}; choose one of: {', '.join(choices)}"
                         + did_you_mean(value, choices))


def refuse_options_of_others(section: Any, name: str, chosen: Any, specs: tuple[Any, ...]) -> None:
    """UsageError when ``section`` gives (away from its default) an option that only another
    registered choice of the setting ``name`` reads; every spec lists its ``options``.

    Example::

        >>> refuse_options_of_others(SyncConfig(clusters="2"), "sync", allreduce, STRATEGIES.specs())
        Traceback (most recent call last):
        convoy.errors.UsageError: --clusters, --indicator-weights and --node-profile need --sync hierarchical
    """
    fields = {f.name: f for f in dataclasses.fields(section)}
    for spec in specs:
        given = [option for option in spec.options if getattr(section, option) != fields[option].default]
        if spec is not chosen and given:
            flags = [flag(fields[option].metadata["flag"] or option) for option in spec.options]
            listed = ", ".join(flags[:-1]) + " and " + flags[-1] if len(flags) > 1 else flags[0]
            raise UsageError(f"{listed} need{'s' if len(flags) == 1 else ''} {flag(name)} {spec.name}")
