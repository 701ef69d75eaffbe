"""How a worker ends: its failure reported to stderr and the launcher's error file, then a hard exit."""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable, NoReturn

from convoy.errors import TrainingDiverged, UsageError

ERROR_FILE_ENV = "CONVOY_ERROR_FILE"
DIVERGED_EXIT = 3   # the run stopped on a non-finite loss or gradient


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, UsageError):
        return 2
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, TrainingDiverged):
        return DIVERGED_EXIT
    return 1


def report_failure(exc: BaseException, rank: int) -> int:
    """Describe ``exc`` once, where the launcher (or a torchrun user) will look; return the exit code."""
    code = exit_code(exc)
    expected = code in (2, DIVERGED_EXIT)   # the user's input or the run's numbers, not a bug: no traceback
    summary = str(exc) if expected else f"{type(exc).__name__}: {exc}"
    details = "" if expected else "".join(traceback.format_exception(exc))
    path = os.environ.get(ERROR_FILE_ENV)
    if path:  # the launcher prints the first failure, once for the whole job
        with open(path, "w") as f:
            json.dump({"rank": rank, "code": code, "summary": summary, "traceback": details}, f)
        return code
    sys.stderr.write(details)
    print(f"convoy: error: rank {rank}: {summary}" if code != 2 else f"convoy: error: {summary}",
          file=sys.stderr, flush=True)
    return code


def read_failure(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_and_exit(body: Callable[[], None], rank: int) -> NoReturn:
    """Run a worker's ``body``, report a failure, and end the process with its exit code.

    The process ends with ``os._exit`` on success too. On failure the
    auxiliary thread may sit in a collective with a dead peer, and a normal
    exit would wait for it. On success gloo's worker threads may still drop
    the last reference to a tensor while the interpreter finalizes; Python
    then ends that thread with ``pthread_exit``, which C++ turns into
    ``std::terminate`` (a SIGABRT after the job's work is all done).
    """
    try:
        body()
        code = 0
    except BaseException as exc:
        code = report_failure(exc, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
