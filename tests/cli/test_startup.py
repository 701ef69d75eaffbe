"""Start-up under torchrun that cannot hang: an unreachable store fails within --timeout with one line
naming what to set, and a stop signal is obeyed while a worker waits for its peers."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import fork_server, require_timeout

# A worker of a two-rank torchrun job whose agent store (MASTER_ADDR:MASTER_PORT) is the test's socket.
AGENT_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "startup"}
TRAIN = ("--steps", "2", "--no-progress", "--eval-every", "0")


def _worker(port: int, timeout: str, tmp_path) -> subprocess.Popen:
    """``convoy train`` as rank 1 under torchrun, its agent store at 127.0.0.1:``port``."""
    require_timeout("starts a convoy worker")
    env = {**os.environ, **AGENT_ENV, "MASTER_PORT": str(port)}
    env.pop("GLOO_SOCKET_IFNAME", None)
    return subprocess.Popen([sys.executable, "-m", "convoy", "train", *TRAIN, "--timeout", timeout,
                             "--out", str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _silent_store():
    """A listening socket that accepts and never answers: a store the worker reaches but cannot use."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(120)
    return listener


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.timeout(180)
def test_a_store_that_never_answers_fails_within_the_timeout_with_one_line_naming_what_to_set(tmp_path):
    with _silent_store() as listener:
        worker = _worker(listener.getsockname()[1], "3", tmp_path)
        connection, _ = listener.accept()   # the worker is in its start-up now
        started = time.monotonic()
        _, stderr = worker.communicate(timeout=60)
        elapsed = time.monotonic() - started
        connection.close()
    assert worker.returncode == 1, stderr
    # Within the timeout (3 s, counted from before the connection) and a slack for exiting on a busy machine.
    assert elapsed < 3 + 2, elapsed
    [line] = _lines(stderr)
    assert line.startswith("convoy: error: rank 1: rank 1 could not reach the rendezvous store at 127.0.0.1:"), line
    assert "within 3 s (--timeout)" in line and "--local-addr" in line and "GLOO_SOCKET_IFNAME" in line, line


@pytest.mark.timeout(180)
def test_a_stop_signal_is_obeyed_while_the_start_up_waits(tmp_path):
    with _silent_store() as listener:
        worker = _worker(listener.getsockname()[1], "300", tmp_path)
        connection, _ = listener.accept()
        time.sleep(0.5)   # in torch's store client now, blocked in C++ until the timeout (300 s)
        worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = worker.communicate(timeout=60)
        elapsed = time.monotonic() - started
        connection.close()
    assert worker.returncode == 128 + signal.SIGTERM, stderr
    assert elapsed < 2, elapsed
    assert _lines(stderr) == ["convoy: stopped by SIGTERM to rank 1 before training started"], stderr


def _init_against(port: int, timeout_s: float, results) -> None:
    os.environ.update(AGENT_ENV, MASTER_PORT=str(port))
    import convoy
    from convoy.errors import StartupFailed

    started = time.monotonic()
    try:
        convoy.init(timeout_s=timeout_s)
        results.put(("joined", 0.0))
    except StartupFailed as exc:
        results.put((str(exc), time.monotonic() - started))


@pytest.mark.timeout(120)
def test_init_against_a_closed_port_raises_within_the_timeout():
    """The API (``convoy.init``) bounds its start-up too: a closed port is retried until the timeout."""
    require_timeout("starts a process")
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    context = fork_server()
    results = context.Queue()
    process = context.Process(target=_init_against, args=(port, 2.0, results))
    process.start()
    try:
        message, elapsed = results.get(timeout=60)
    finally:
        process.kill()
        process.join()
    assert 2.0 <= elapsed < 2.0 + 1.5, elapsed
    assert f"could not reach the rendezvous store at 127.0.0.1:{port}" in message
    assert "--local-addr" in message and "GLOO_SOCKET_IFNAME" in message
