"""What tests in several packages share: worlds of gloo processes, the convoy command, seeded models and data.

Every name here is public; tests import them (``from tests.helpers import convoy``), never a private
name of another test module.
"""
from __future__ import annotations

import contextlib
import functools
import io
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import torch
from torch import nn

from convoy.checkpoint.files import committed_step
from convoy.runtime import QUIET_RANK_ENV
from convoy.utils.spawn import free_port, rank_entry

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 120

# Forked worlds start from a server process that imported these once (seconds each), not from a
# fresh interpreter per rank; each rank is still a process of its own with its own gloo group.
# scikit-learn too: convoy.data.digits imports it only when digits are loaded, which every rank does.
_PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo", "convoy", "convoy.data",
            "convoy.engine", "convoy.sync", "convoy.compress", "convoy.parallel", "convoy.cli.main",
            "convoy.train.loop", "sklearn.datasets", "sklearn.model_selection"]
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(_PRELOAD)


def fork_server() -> multiprocessing.context.BaseContext:
    """The fork server's context, its server started (once) in the environment convoy's launcher gives
    its ranks: torch reads its C++ log level when the server imports it, and every process forked from
    the server keeps what it read (a forked rank setting the variable later changes nothing)."""
    with _environment({**QUIET_RANK_ENV, **os.environ}):
        multiprocessing.forkserver.ensure_running()
    return _FORKSERVER


# The test being run (set by conftest's pytest_runtest_protocol): helpers that start processes
# check that it carries a timeout, so a hung collective fails that test, soon.
running_test: list[pytest.Item] = []


def require_timeout(what: str) -> None:
    """Fail the running test unless it is marked ``@pytest.mark.timeout(N)``: it ``what``."""
    if running_test and running_test[0].get_closest_marker("timeout") is None:
        pytest.fail(f"{running_test[0].nodeid} {what}: mark it @pytest.mark.timeout(seconds)", pytrace=False)


# ------------------------------------------------------------------ worlds of processes
def run_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined by a gloo group; return
    their results in rank order.

    Like :func:`convoy.utils.spawn.run_in_processes`, but the processes are forked from
    multiprocessing's fork server, which imported torch and convoy once for the whole test session:
    a world starts in a fraction of a second instead of one interpreter start per rank. ``fn`` must
    be defined at module level and return something picklable.

    Example::

        >>> def rank_times_two(rank, world):
        ...     return rank * 2
        >>> run_workers(rank_times_two, 2)
        [0, 2]
    """
    import torch.multiprocessing as mp

    require_timeout("starts a world of processes")
    fork_server()
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(rank_entry, args=(world_size, free_port(), out_dir, fn, args),
                                     nprocs=world_size, join=False, start_method="forkserver")
        try:
            while not context.join():
                pass
        finally:
            # A test timeout (or any error) interrupts the join: no worker may outlive the test.
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]


# ------------------------------------------------------------------ the convoy command
def convoy(*args: str, cwd: Path | None = None, env: dict | None = None,
           timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m convoy ARGS`` in a new process, as a user runs it: exit status, stdout and stderr."""
    require_timeout("runs the convoy command in a new process")
    return subprocess.run([sys.executable, "-m", "convoy", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def convoy_in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The convoy command with this process as its launcher: exit status, stdout and stderr.

    What ``convoy`` itself prints and what the worker processes it starts print (through
    file descriptors 1 and 2) are both captured. The launcher is convoy's own (rendezvous,
    supervision, error reports); only its workers start differently: forked from the fork server
    that imported torch and convoy once (:class:`ForkedRank`), not as fresh interpreters that
    import them again (seconds of CPU each). Tests of the launcher process itself and of what a
    fresh worker process does (signals, exit statuses) use :func:`convoy`. ``env`` (as from
    :func:`importable`) is set for the command, its PYTHONPATH put on this process's ``sys.path``.
    """
    from convoy.cli import launch
    from convoy.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile("w+") as out_fd, tempfile.TemporaryFile("w+") as err_fd:
        with _file_descriptors_to(out_fd, err_fd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                _attribute(launch, "subprocess", _FORKED_SUBPROCESS), _environment(env or {}):
            try:
                code = main(list(args))
            except SystemExit as exc:   # argparse's own errors
                code = exc.code
        if code == 0 and args[0] in ("train", "profile-nodes") and "--help" not in args:
            require_timeout("starts convoy's worker processes")
        out_fd.seek(0)
        err_fd.seek(0)
        return subprocess.CompletedProcess(["convoy", *args], code, out_fd.read() + out.getvalue(),
                                           err_fd.read() + err.getvalue())


# Where ForkedRank forks a rank from: the session's fork server, except in a launcher that
# kill_when forked from it (_forked_launcher_main), which forks its ranks itself.
_rank_context: multiprocessing.context.BaseContext = _FORKSERVER
# The threads such a launcher had when it started (None elsewhere): it may fork only while it has
# started none, since a lock a thread holds at the fork stays held in the child for good.
_launcher_threads: int | None = None


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Forked:
    """A started multiprocessing process with the part of :class:`subprocess.Popen` that convoy's
    launcher and :func:`kill_when` use (``pid``, ``poll``, ``wait``, ``returncode``)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self.poll()


class ForkedRank(_Forked):
    """A worker of convoy's launcher forked from the tests' fork server, with the part of
    :class:`subprocess.Popen` the launcher uses (``pid``, ``poll``, ``wait``, ``returncode``).

    The rank runs ``python -m convoy ARGV[3:]`` as ``convoy.cli.main.main(ARGV[3:])`` in a process
    of its own: in its own process group (what ``process_group=0`` asks), in the launcher's current
    directory and environment, its output on the launcher's file descriptors 1 and 2.
    """

    def __init__(self, argv: list[str], env: dict[str, str], **_: Any):
        assert argv[1:3] == ["-m", "convoy"], argv
        if _launcher_threads is not None and _threads() != _launcher_threads:
            raise RuntimeError(f"the launcher runs {_threads()} threads, not the {_launcher_threads} it began with: "
                               "a rank forked from it could inherit a lock held for good")
        context = fork_server() if _rank_context is _FORKSERVER else _rank_context
        super().__init__(context.Process(target=_forked_rank_main,
                                         args=(argv[3:], env, os.getcwd(), os.getpid())))


def _forked_rank_main(argv: list[str], env: dict[str, str], cwd: str, launcher: int) -> None:
    from convoy.cli.main import main

    os.setpgid(0, 0)
    for fd in (1, 2):   # the launcher's, as a child of the launcher would inherit them
        with contextlib.suppress(OSError):
            target = os.open(f"/proc/{launcher}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            os.dup2(target, fd)
            os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # What a fresh interpreter would have found on PYTHONPATH (users' model files).
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.exit(main(argv))


_FORKED_SUBPROCESS = type("ForkedSubprocess", (), {"Popen": ForkedRank})


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """Set ``env`` in ``os.environ`` and its PYTHONPATH on ``sys.path`` for the block."""
    saved_environ, saved_path = dict(os.environ), list(sys.path)
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.path[:] = saved_path


@contextlib.contextmanager
def _attribute(owner: object, name: str, value: object):
    """Set ``owner.name`` to ``value`` for the block."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def _file_descriptors_to(stdout, stderr):
    """Point file descriptors 1 and 2 (what child processes inherit) at two files for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single line a refused command printed; fails unless it exited 2 with one line and no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def importable(directory: Path) -> dict[str, str]:
    """Environment variables under which a child process imports modules written into ``directory``."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}


def saved_model(run: Path) -> dict[str, torch.Tensor]:
    """The parameters a ``convoy train`` run saved in its folder's model.pt."""
    return torch.load(run / "model.pt")["model"]


# ------------------------------------------------------------------ models and data
def ps_groups(settings: Any, world: int) -> Any:
    """The process groups of a parameter-server job of ``world`` ranks (call on every rank)."""
    from convoy.parallel.groups import ProcessGroups
    from convoy.parallel.shape import JobShape

    return ProcessGroups.create(JobShape(world, servers=0 if settings.colocated else settings.servers), ps=settings)


def seeded_model(name: str) -> nn.Module:
    """convoy's model ``name`` for digits (1 channel, 10 classes), initialised from seed 0."""
    from convoy.models import build_model

    torch.manual_seed(0)
    return build_model(name, in_channels=1, num_classes=10)


@functools.lru_cache(maxsize=None)
def digits():
    """The digits dataset (built once per process)."""
    from convoy.data import build_dataset

    return build_dataset("digits")


def digits_batches(world: int, rank: int, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s share (``batch`` samples) of the first ``steps`` global batches of digits, sampler seed 3."""
    from convoy.data import GlobalBatchSampler, iterate_batches

    data = digits()
    sampler = GlobalBatchSampler(len(data.train), batch, world, rank, seed=3)
    out, epoch = [], 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        out += list(iterate_batches(data.train, sampler))[: steps - len(out)]
        epoch += 1
    return out


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, detached, in one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------------ node profiles (hierarchical sync)
def indicator_table(**values: object) -> str:
    """TOML lines setting every node indicator to 1, except those given (strings quoted)."""
    from convoy.cluster import INDICATORS

    merged = {name: values.get(name, 1) for name in INDICATORS}
    return "\n".join(f"{name} = {value!r}".replace("'", '"') for name, value in merged.items())


def profile_toml(slow: tuple[int, ...], disk: object = 400) -> str:
    """A --node-profile file: every rank fast, the ``slow`` ranks with a slow CPU and uplink."""
    fast = "[all]\n" + indicator_table(cpu_mhz=3000, memory_gb=16, gpu_mhz=0, gpu_memory_gb=0, disk_mbps=disk,
                                       uplink_mbps=1000) + "\n"
    return fast + "".join(f"[ranks.{rank}]\ncpu_mhz = 1200\nuplink_mbps = 50\n" for rank in slow)


class _ForkedLauncher(_Forked):
    """``convoy train ARGS`` with a launcher forked from the tests' fork server (:func:`kill_when`'s
    ``forked``), with the part of :class:`subprocess.Popen` that kill_when uses; what it printed on
    stderr is in the file ``stderr``."""

    def __init__(self, args: list[str], stderr: Path):
        self._stderr = stderr
        super().__init__(fork_server().Process(target=_forked_launcher_main,
                                               args=(args, os.getcwd(), dict(os.environ), str(stderr))))
        # Returns, as Popen(start_new_session=True) does, once the launcher leads a session of its own:
        # a kill of its process group cannot come before there is one.
        while self.poll() is None:
            with contextlib.suppress(ProcessLookupError):   # ended, its status not read yet
                if os.getsid(self.pid) == self.pid:
                    break
            time.sleep(0.001)

    def communicate(self) -> tuple[None, str]:
        self.wait()
        return None, self._stderr.read_text() if self._stderr.exists() else ""


def _forked_launcher_main(args: list[str], cwd: str, env: dict[str, str], stderr: str) -> None:
    """``convoy train ARGS`` as :func:`convoy_in_process` runs it, in a session of its own (as
    ``start_new_session`` gives a new process), its ranks forked from this process.

    Forked from the fork server, this process has torch, scikit-learn and convoy imported and has
    run nothing: forking its ranks from it (not from a fork server of its own, a fresh interpreter
    that would import them all again) is safe while it starts no thread, which ForkedRank checks.
    """
    global _rank_context, _launcher_threads
    import threading

    from tqdm import tqdm

    os.setsid()
    # Each rank's progress bar would make tqdm's default lock, a semaphore registered with the
    # session's resource tracker: a killed rank cannot unregister it, and the tracker reports it as
    # leaked when the session ends. A thread lock set here, which every rank inherits, leaves none.
    tqdm.set_lock(threading.RLock())
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _rank_context, _launcher_threads = multiprocessing.get_context("fork"), _threads()
    try:
        result = convoy_in_process("train", *args)
    except BaseException:   # kill_when's failure message shows it
        Path(stderr).write_text(traceback.format_exc())
        raise
    Path(stderr).write_text(result.stderr)
    sys.exit(result.returncode)


def kill_at_checkpoint(args: tuple[str, ...] | list[str], checkpoints: Path, files: int, step: int,
                       delay_s: float, timeout_s: float = 600) -> None:
    """Run ``convoy train *args`` and SIGKILL every process of it ``delay_s`` after its ``files`` model
    files (``model-rank*.ckpt`` in ``checkpoints``) all committed ``step`` or later.

    The kill is placed by the job's progress, not by the clock, so a fast machine cannot finish the
    job before it; ``delay_s`` (a small seeded draw) moves it to a random point of a later step.
    Fails when the job ends, or gets no checkpoint within ``timeout_s``, before the kill.

    The launcher's ranks are forked from a fork server (``kill_when``'s ``forked``), as the
    random-kill test's are: real processes of their own, every one of them killed, that skip an
    interpreter start and torch's import each (seconds of CPU a rank). What a kill test checks is
    what the checkpoint files hold; how a fresh rank starts and dies is tests/cli/test_robust.py's.
    """
    killed = kill_when(args, checkpoints, files, step, delay_s, timeout_s, forked=True)
    assert killed, "the job ended before the kill"


def kill_when(args: tuple[str, ...] | list[str], checkpoints: Path, files: int, step: int, delay_s: float,
              timeout_s: float = 600, forked: bool = False) -> bool:
    """Run ``convoy train *args`` and SIGKILL its process group and every rank ``delay_s`` after its
    ``files`` model files in ``checkpoints`` all committed ``step`` or later (``files=0``: ``delay_s``
    after the start, wherever the job then is); whether the job was still running when killed.

    ``forked``: the launcher process runs :func:`convoy_in_process`, forked from the fork server that
    imported torch and convoy once for the session, and forks its ranks from itself (no interpreter
    start, for the launcher or a rank); still real processes of their own, every one of them killed.

    Example::

        >>> kill_when([*job, "--checkpoint-dir", str(k)], k, files=1, step=3, delay_s=0.05)
        True
    """
    require_timeout("kill_when")
    stderr = Path(tempfile.mkdtemp(prefix="convoy-kill-")) / "launcher.err"
    launcher = _ForkedLauncher(list(args), stderr) if forked else \
        subprocess.Popen([sys.executable, "-m", "convoy", "train", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while files:
            committed = [committed_step(path) for path in checkpoints.glob("model-rank*.ckpt")]
            if len(committed) >= files and min(committed) >= step:
                break
            if launcher.poll() is not None:
                assert launcher.returncode == 0, launcher.communicate()[1][-2000:]
                return False
            assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout_s} s"
            time.sleep(0.005)
        time.sleep(delay_s)
        return launcher.poll() is None
    finally:
        ranks = _stopped_tree(launcher.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for rank in ranks:    # also those a launcher started in sessions of their own
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        launcher.wait(timeout=30)
        psutil.wait_procs(ranks, timeout=30)
        shutil.rmtree(stderr.parent, ignore_errors=True)


def _stopped_tree(pid: int) -> list[psutil.Process]:
    """SIGSTOP ``pid`` and every process below it, until no new one appears; the processes below.

    A stopped process starts no other, so a rank being started at the moment of the kill is
    found and killed too instead of outliving the job (it sits in a process group of its own).
    """
    stopped: dict[int, psutil.Process] = {}
    while True:
        try:
            root = psutil.Process(pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = list(stopped.values())
        new = [p for p in found if p.pid not in stopped]
        if not new:
            return [p for p in stopped.values() if p.pid != pid]
        for process in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGSTOP)
            stopped[process.pid] = process


def dying_model(call: int, rank_variable: str = "RANK", kill: str = "os.kill(os.getpid(), signal.SIGKILL)",
                marker_variable: str = "CRASH_MARKER") -> str:
    """Source of a module whose ``factory()`` is LeNet plus a forward pre-hook that runs ``kill`` at
    its ``call``-th forward on the process whose ``rank_variable`` is 1, once: the file the variable
    ``marker_variable`` names marks it done, so a restarted process trains on like the model."""
    return f"""
import os, signal
from pathlib import Path
from convoy.models.lenet import lenet

def factory():
    model = lenet()
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        marker = Path(os.environ["{marker_variable}"])
        if os.environ["{rank_variable}"] == "1" and calls[0] == {call} and not marker.exists():
            marker.touch()
            {kill}

    model.register_forward_pre_hook(hook)
    return model
"""


def same_saved_models(a: Path, b: Path) -> None:
    """The run folders ``a`` and ``b`` saved the same model.pt: every parameter and every tensor of
    every layer optimizer's state (momentum buffers, where the optimizers keep the momentum) equal."""
    x, y = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert x["model"].keys() == y["model"].keys()
    for key in x["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), key
    assert len(x["optimizers"]) == len(y["optimizers"])
    for layer, (p, q) in enumerate(zip(x["optimizers"], y["optimizers"])):
        assert p["state"].keys() == q["state"].keys(), layer
        for index, state in p["state"].items():
            for name, value in state.items():
                if torch.is_tensor(value):
                    assert torch.equal(value, q["state"][index][name]), f"layer {layer}: {name}"
