"""Shared plumbing of the benchmarks: spawning gloo workers (local or on emulated hosts), tables, result files."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from convoy.utils.spawn import run_in_processes as spawn  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).parent / "results"
HOST_RANK = Path(__file__).resolve().parent / "host_rank.py"   # the script each rank of run_on_hosts runs


# How often a launcher's wait looks at its stop event (run_stopping): a stopped bench's runs end this soon.
STOP_POLL_S = 0.5


class RunStopped(Exception):
    """A launcher stopped because its bench was (:func:`run_stopping`'s ``stop``)."""


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind the bench as Ctrl-C does: every ``finally`` and ``with`` on the way out runs,
    so a launcher it started is stopped (:func:`run_stopping`) and its folders are removed."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_stopping(argv: list[str], time_limit_s: float | None, stop_wait_s: float,
                 stop: threading.Event | None = None) -> tuple[int, str, bool]:
    """Run ``argv`` (a launcher, which stops its ranks on SIGTERM) to its end or for ``time_limit_s``.

    Past the limit, when the bench itself is interrupted, or once ``stop`` is set (how a bench that
    runs launchers from worker threads, where no interruption arrives, stops them), the launcher gets
    SIGTERM and ``stop_wait_s`` to stop before it is killed: a bench that is stopped leaves no training
    job behind. Returns the exit status, stderr, and whether the limit stopped it; an interruption is
    raised again once the launcher is gone, and a ``stop`` raises :class:`RunStopped`.

    Example::

        >>> status, stderr, limited = run_stopping(launcher(command, 4, "100mbit"), 300, STOP_WAIT_S)
    """
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    # Nothing between the launcher's start and the try: an interruption there would leave it running.
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if stop is not None:
                wait = STOP_POLL_S if wait is None else min(wait, STOP_POLL_S)
            try:
                stderr = proc.communicate(timeout=wait)[1]
                return proc.returncode, stderr, False
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if stop is not None and stop.is_set():
                    raise RunStopped(shlex.join(argv[:6]) + " ...") from None
    except BaseException:
        _stop(proc, argv, stop_wait_s)
        raise
    stderr = _stop(proc, argv, stop_wait_s)
    return proc.returncode, stderr, True


def _stop(proc: subprocess.Popen, argv: list[str], stop_wait_s: float) -> str:
    """SIGTERM to ``proc``, SIGKILL if it has not stopped after ``stop_wait_s``; its stderr."""
    proc.terminate()
    try:
        return proc.communicate(timeout=stop_wait_s)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{shlex.join(argv[:6])} ... did not stop within {stop_wait_s:g} s of SIGTERM") from None


def launcher(command: list[str], hosts: int, rate: str, cluster: str | None = None,
             tcp_congestion: str | None = None) -> list[str]:
    """``command`` on ``hosts`` emulated hosts (``cluster``: a cluster file that describes them, slow
    hosts included; ``tcp_congestion``: their TCP congestion control, else the machine's), or as
    ``hosts`` local processes when ``rate`` is loopback."""
    congestion = ["--tcp-congestion", tcp_congestion] if tcp_congestion else []
    if cluster:
        return [sys.executable, "-m", "convoy", "bench", "cluster", "--cluster", cluster, *congestion, "--", *command]
    if rate != "loopback":
        return [sys.executable, "-m", "convoy", "bench", "cluster", "--hosts", str(hosts), "--rate", rate,
                *congestion, "--", *command]
    if command[0] == "train":
        return [sys.executable, "-m", "convoy", *command, "--nproc", str(hosts)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(hosts), *command]


def run_on_hosts(fn: Callable[..., Any], hosts: int, rate: str, *args: Any) -> list[Any]:
    """``spawn``'s twin on emulated hosts: ``fn(rank, world, *args)`` once per host, one rank each,
    started by ``launcher`` (``convoy bench cluster``: root, and the caller holds the namespace
    lock; ``rate`` loopback: local processes under torchrun); their results in rank order.

    Each rank joins a gloo default group from the launcher's variables with one torch thread, as
    ``spawn``'s ranks do. ``fn`` is found again in the rank by its module's file and its name (a
    benchmark run as a script is ``__main__``), so it must be defined at module level; ``args``
    and the results must pickle. A failing rank raises with the launcher's stderr.

    Example::

        >>> run_on_hosts(worker, 4, "100mbit", "vgg_fc")   # worker(rank, 4, "vgg_fc") on each host
    """
    module = sys.modules[fn.__module__]
    with tempfile.TemporaryDirectory(prefix="convoy-bench-hosts-") as out:
        Path(out, "job.pkl").write_bytes(pickle.dumps((str(Path(module.__file__).resolve()), fn.__name__, args)))
        result = subprocess.run(launcher([str(HOST_RANK), out], hosts, rate),
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{fn.__name__} on {hosts} hosts at {rate} failed:\n{result.stderr[-3000:]}")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(hosts)]


def host_rank(out: str) -> None:
    """One rank of ``run_on_hosts`` (bench/host_rank.py, on its host): join the group, run the job in
    ``out``, write ``out/<rank>.pkl``."""
    import torch.distributed as dist

    path, name, args = pickle.loads(Path(out, "job.pkl").read_bytes())
    spec = importlib.util.spec_from_file_location("_bench_on_host", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses and pickles look their module up by name
    spec.loader.exec_module(module)   # not as __main__: the benchmark's own main() does not run here
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(getattr(module, name)(rank, dist.get_world_size(), *args)))
        dist.barrier()   # rank 0 holds the store: it stays until every rank is done with it
    finally:
        dist.destroy_process_group()


def machine() -> dict[str, Any]:
    """Where, when and how a result was measured: the command is recorded as it ran, so the
    pages that show the result print it from here (it cannot drift from what ran)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"host": platform.node(), "cpus": os.cpu_count(), "cpu": cpu_kind(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line()}


def cpu_kind() -> str:
    """The CPU's model and the vector unit torch's kernels use: a run's floating-point results, and so
    its steps to an accuracy, can differ between CPUs (MKL picks kernels by the instructions there)."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def command_line() -> str:
    """This process's command as a user types it from the repository root: ``python bench/x.py ARGS``."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])


def timed_round(step: Callable[[], Any], finish: Callable[[], Any], steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds (every thread) per step of ``steps`` calls of ``step`` and the
    drain (``finish``), all ranks of the default group started together by a barrier."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    finish()
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def save(name: str, settings: dict[str, Any], rows: list[dict[str, Any]], columns: Sequence[str]) -> Path:
    """Write results/<name>.json and results/<name>.md; print the table."""
    RESULTS.mkdir(exist_ok=True)
    text = table(rows, columns)
    print(text)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "settings": settings, "rows": rows}, indent=2))
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\nsettings: `{json.dumps(settings)}`\n\n{text}\n")
    return path
