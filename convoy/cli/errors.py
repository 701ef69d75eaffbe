"""How a worker ends: its failure reported to stderr and the launcher's error file, then a hard exit."""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable, NoReturn

from convoy.errors import JobStopped, StartupFailed, TrainingDiverged, UsageError, one_line, peer_lost
from convoy.utils.lifetime import StopOverdue, Stopped

ERROR_FILE_ENV = "CONVOY_ERROR_FILE"
DIVERGED_EXIT = 3   # the run stopped on a non-finite loss or gradient


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, UsageError):
        return 2
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, TrainingDiverged):
        return DIVERGED_EXIT
    if isinstance(exc, (JobStopped, Stopped)):   # as if the signal had ended the process
        return 128 + exc.signum
    return 1


def is_stop(code: int) -> bool:
    """An exit status of a worker that a stop signal ended in order (see :func:`exit_code`)."""
    return code > 128


def _summary(exc: BaseException, rank: int) -> str:
    if isinstance(exc, StopOverdue):
        return (f"stopped by {exc} to rank {rank}: the other ranks did not agree on a step to stop at within "
                f"{exc.bound_s:g} s (gone or unreachable), so it ended alone; a resume goes on from the last "
                "committed checkpoint")
    if isinstance(exc, Stopped):
        return f"stopped by {exc} to rank {rank} before training started"
    return str(exc) if isinstance(exc, (UsageError, TrainingDiverged, JobStopped, StartupFailed)) \
        else f"{type(exc).__name__}: {exc}"


def report_failure(exc: BaseException, rank: int) -> int:
    """Describe ``exc`` once, where the launcher (or a torchrun user) will look; return the exit code."""
    code = exit_code(exc)
    # The user's input, the run's numbers, a setting of the network or a stop signal, not a bug: no traceback.
    expected = code in (2, DIVERGED_EXIT) or is_stop(code) or isinstance(exc, StartupFailed) or peer_lost(exc)
    summary = one_line(_summary(exc, rank))
    details = "" if expected else "".join(traceback.format_exception(exc))
    path = os.environ.get(ERROR_FILE_ENV)
    if path:  # the launcher prints the first failure, once for the whole job
        report = {"rank": rank, "code": code, "summary": summary, "traceback": details}
        if isinstance(exc, JobStopped):   # the launcher words the line itself when it was signalled
            report["stop"] = {"step": exc.step, "detail": exc.detail()}
        with open(path, "w") as f:
            json.dump(report, f)
        return code
    if is_stop(code):   # under torchrun every rank stops; one line for the job
        if rank == 0 or isinstance(exc, Stopped):
            print(f"convoy: {summary}", file=sys.stderr, flush=True)
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
