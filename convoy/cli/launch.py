"""The local launcher behind ``convoy train --nproc N``: N worker processes on loopback.

Like torchrun on one machine, without the elastic agent: it picks a free port,
starts the workers with the rendezvous variables set, and, as soon as one of
them fails, stops the others and prints the failing rank's error. A stop
signal (to the launcher or to a rank) ends the job in order: every rank
finishes the same step and commits a checkpoint of it, then the launcher
prints one line saying who stopped the job, at which step, and how to resume.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable
from convoy.cli.errors import ERROR_FILE_ENV, is_stop, read_failure
from convoy.runtime import BIND_STORE_ENV, QUIET_RANK_ENV
from convoy.utils.lifetime import STOP_GRACE_S, Stopped, die_with_parent, stop_on_signals
from convoy.utils.spawn import free_port

_POLL_S = 0.05


def launch(config_json: str, nproc: int) -> int:
    """Run ``nproc`` workers of the job ``config_json`` describes; return the job's exit code."""
    with tempfile.TemporaryDirectory(prefix="convoy-launch-") as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_text(config_json)
        argv = [sys.executable, "-m", "convoy", "_worker", str(config_path)]
        return run_ranks(lambda rank: argv, nproc, "127.0.0.1", "lo")


def run_ranks(argv_of: Callable[[int], list[str]], nproc: int, master_addr: str, interface: str) -> int:
    """Start ``argv_of(rank)`` for every rank with torchrun's variables set; supervise them.

    Args:
        argv_of: the command of each rank (a prefix may place it in a namespace).
        nproc: the world size.
        master_addr: the address where rank 0 listens for the rendezvous.
        interface: the network interface gloo uses (GLOO_SOCKET_IFNAME), unless set already.
    """
    launcher = os.getpid()
    with tempfile.TemporaryDirectory(prefix="convoy-ranks-") as tmp, stop_on_signals():
        port = free_port()
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(nproc):
                env = {**QUIET_RANK_ENV, **os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": master_addr,
                       "MASTER_PORT": str(port), ERROR_FILE_ENV: str(Path(tmp, f"rank{rank}.json")), BIND_STORE_ENV: "1"}
                env.setdefault("GLOO_SOCKET_IFNAME", interface)
                # Their own process group: a terminal's Ctrl-C reaches the launcher alone,
                # which then stops every rank; the death signal covers a SIGKILLed launcher.
                procs.append(subprocess.Popen(argv_of(rank), env=env, process_group=0,
                                              preexec_fn=lambda: die_with_parent(launcher)))
            return _supervise(procs, Path(tmp))
        except Stopped as stop:
            return _stop_in_order(procs, Path(tmp), stop.signum, f"the launcher (pid {launcher})")


def _supervise(procs: list[subprocess.Popen], error_dir: Path) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            report = read_failure(str(error_dir / f"rank{failed[0]}.json")) or {}
            if "stop" in report:   # the ranks agreed to stop after a step: the others are committing it too
                _wait_all(procs, STOP_GRACE_S)
            _stop(procs)
            rank = _first_failure(failed, error_dir)
            return _explain(rank, procs[rank].returncode, error_dir)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(_POLL_S)


def _stop_in_order(procs: list[subprocess.Popen], error_dir: Path, signum: int, receiver: str) -> int:
    """Pass the launcher's stop signal on to every rank, wait for their checkpoint, and say so in one line.

    A second signal while they finish kills them at once.
    """
    name = signal.Signals(signum).name
    for p in procs:
        _signal_group(p, signum)
    try:
        with stop_on_signals():
            finished = _wait_all(procs, STOP_GRACE_S)
    except Stopped:
        finished = False
    _stop(procs)
    if all(p.returncode == 0 for p in procs):
        print(f"convoy: {receiver} received {name} after the last step; the run completed",
              file=sys.stderr, flush=True)
        return 0
    reports = [read_failure(str(error_dir / f"rank{rank}.json")) for rank in range(len(procs))]
    stops = [r["stop"] for r in reports if r and "stop" in r]
    if finished and stops:
        where = f" at step {stops[0]['step']}; {stops[0]['detail']}"
    elif finished:
        where = "; every rank was stopped"
    else:
        where = f"; the ranks did not stop within {STOP_GRACE_S:g} s and were killed (a resume goes on from " \
                "the last committed checkpoint)"
    print(f"convoy: stopped by {name} to {receiver}{where}", file=sys.stderr, flush=True)
    return 128 + signum


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> bool:
    """Wait up to ``seconds`` for every rank to end; True when they all did."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _first_failure(failed: list[int], error_dir: Path) -> int:
    """The rank that failed first: the oldest error file, else the lowest rank.

    Peers of a failed worker fail too (their connections close), moments later.
    """
    reported = [(Path(error_dir, f"rank{r}.json").stat().st_mtime, r) for r in failed
                if Path(error_dir, f"rank{r}.json").exists()]
    silent = [r for r in failed if r not in {rank for _, rank in reported}]
    # A rank that ended without a report was killed from outside; its peers only
    # report the connection it closed, so the job stopped because of it.
    return silent[0] if silent else min(reported)[1]


def _explain(rank: int, code: int, error_dir: Path) -> int:
    failure = read_failure(str(error_dir / f"rank{rank}.json"))
    if failure is None:
        how = (f"was stopped by {signal.Signals(-code).name} from outside the job" if code < 0
               else f"exited with status {code}")
        print(f"convoy: error: rank {rank} {how}", file=sys.stderr, flush=True)
        return 1
    if is_stop(failure["code"]):
        print(f"convoy: {failure['summary']}", file=sys.stderr, flush=True)
        return failure["code"]
    if failure["code"] != 2 and failure.get("traceback"):
        print(f"convoy: rank {rank} failed; its traceback:\n{failure['traceback']}", file=sys.stderr, end="")
    print(f"convoy: error: rank {rank}: {failure['summary']}" if failure["code"] != 2
          else f"convoy: error: {failure['summary']}", file=sys.stderr, flush=True)
    return failure["code"]


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (its process group) and reap it.

    SIGKILL, not SIGTERM: a worker treats SIGTERM as a request to stop after
    a step its peers agree on, which peers that failed can no longer give;
    what it was writing is a checkpoint area without a commit record, ignored.
    """
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
