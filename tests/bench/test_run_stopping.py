"""A bench's launcher stops with the bench: at the run's time limit, and when the bench gets SIGTERM or Ctrl-C."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.common import RunStopped, run_stopping

ROOT = Path(__file__).resolve().parents[2]


def _sleeper(pid_file: Path) -> list[str]:
    """A stand-in launcher: writes its pid, then waits far longer than any test."""
    return [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                  "time.sleep(600)"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie has exited; only its parent's wait is missing
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _pid(pid_file: Path, deadline_s: float = 30.0) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in launcher never started")


@pytest.mark.timeout(60)
def test_a_run_past_its_limit_is_stopped(tmp_path):
    status, _, limited = run_stopping(_sleeper(tmp_path / "pid"), time_limit_s=1.0, stop_wait_s=10.0)
    assert limited and status == -signal.SIGTERM
    assert not _alive(_pid(tmp_path / "pid"))


@pytest.mark.timeout(60)
def test_a_run_within_its_limit_keeps_its_status(tmp_path):
    status, stderr, limited = run_stopping([sys.executable, "-c", "import sys; sys.exit('bad flag')"],
                                           time_limit_s=30.0, stop_wait_s=10.0)
    assert (status, stderr.strip(), limited) == (1, "bad flag", False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_bench_leaves_no_launcher(tmp_path, how):
    pid_file = tmp_path / "pid"
    bench = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; from bench.common import run_stopping, stop_on_sigterm; "
                               # Ctrl-C as at a terminal: a shell's background job (CI's pytest may be one)
                               # starts its children with SIGINT ignored.
                               "signal.signal(signal.SIGINT, signal.default_int_handler); "
                               "stop_on_sigterm(); run_stopping(sys.argv[1:], None, 10.0)", *_sleeper(pid_file)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    child = _pid(pid_file)
    bench.send_signal(how)
    _, stderr = bench.communicate(timeout=30)
    assert bench.returncode != 0 and "KeyboardInterrupt" in stderr
    assert not _alive(child)


@pytest.mark.timeout(60)
def test_a_run_in_a_worker_thread_ends_when_its_bench_is_stopped(tmp_path):
    # A bench that runs launchers from worker threads (steps_across_seeds) gets its interruption in the
    # main thread only; the event is how the workers hear of it.
    stop, outcome = threading.Event(), []

    def worker():
        try:
            run_stopping(_sleeper(tmp_path / "pid"), time_limit_s=None, stop_wait_s=10.0, stop=stop)
        except RunStopped as exc:
            outcome.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    child = _pid(tmp_path / "pid")
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(outcome) == 1
    assert not _alive(child)
