"""Careless input and careless operators: bounds on every setting, fuzzed flags and files,
workers that never outlive their launcher, files that are whole or absent."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convoy.cli.main import build_parser
from convoy.cli.train import config_from_args
from convoy.errors import UsageError, one_line
from convoy.train.config import config_settings
from convoy.utils.atomic import save_atomically
from tests.helpers import convoy_in_process, saved_model


def validate(argv: list[str]) -> tuple[int, str]:
    """``convoy train ARGV`` up to the point where workers would start: (exit status, stderr).

    Any exception other than a UsageError escapes, which is the bug the fuzzing looks for.
    """
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            config_from_args(build_parser().parse_args(["train", *argv]))
            return 0, err.getvalue()
        except UsageError as exc:
            print(f"convoy: error: {one_line(str(exc))}", file=sys.stderr)
            return 2, err.getvalue()


def _refused_in_one_line(code: int, stderr: str) -> None:
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("flag,value", [
    ("--nproc", "100000"), ("--threads", "100000"), ("--lr", "inf"), ("--weight-decay", "nan"),
    ("--out", ""), ("--checkpoint-dir", ""), ("--seed", "1e24"), ("--seed", str(2**64)), ("--timeout", "inf"),
    ("--batch-size", "1000000000"), ("--momentum", "nan"), ("--steps", str(10**12)),
    ("--synthetic-shape", "1000,1000,1000"), ("--data-dir", " "),
])
def test_out_of_bounds_settings_are_refused_in_one_line(flag, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused_in_one_line(*validate([flag, value]))
    assert list(tmp_path.iterdir()) == []


_FLAGS = [s.flag for s in config_settings()]
_VALUES = st.one_of(
    st.sampled_from(["", "0", "-1", "1", "2", "inf", "-inf", "nan", "1e24", "0.5", "1e-300", str(2**63),
                     "lenet", "x:y", "os:system", "a,b,c", "1,1,1", "/", ".", "--", "auto", "ps", "hybrid"]),
    st.text(max_size=12), st.integers().map(str), st.floats().map(str))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(_FLAGS), _VALUES), max_size=4))
def test_fuzzed_flags_exit_0_or_2_in_one_line_writing_nothing_outside(tmp_path, flags):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    argv = [a for flag, value in flags for a in (flag, value)
            if not (flag in ("--out", "--checkpoint-dir", "--data-dir", "--init-from") and value.strip())]
    before = set(tmp_path.iterdir())
    cwd = os.getcwd()
    os.chdir(run)
    try:
        code, stderr = validate(argv)
    finally:
        os.chdir(cwd)
    assert code in (0, 2)
    if code == 2:
        _refused_in_one_line(code, stderr)
    assert set(tmp_path.iterdir()) == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200),
                 st.dictionaries(st.sampled_from([s.name for s in config_settings()] + ["bogus"]),
                                 st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans()),
                                 max_size=4).map(lambda d: "\n".join(f"{k} = {_toml(v)}" for k, v in d.items())
                                                 .encode())))
def test_fuzzed_config_files_exit_0_or_2_in_one_line(tmp_path, content):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    code, stderr = validate(["--config", str(path), "--out", str(tmp_path / "run")])
    assert code in (0, 2)
    if code == 2:
        _refused_in_one_line(code, stderr)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(str(value), repr(value))
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode().replace('"', '\\"') + '"'
    return str(value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.booleans())
def test_fuzzed_mnist_files_load_or_are_refused(tmp_path, content, zipped):
    from convoy.data.mnist import load

    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    for name in names:
        path = tmp_path / (name + (".gz" if zipped else ""))
        path.write_bytes(gzip.compress(content) if zipped else content)
    with contextlib.suppress(UsageError):
        load(str(tmp_path))


_MNIST_SHAPES = {"train-images-idx3-ubyte": (28, 28), "train-labels-idx1-ubyte": (),
                 "t10k-images-idx3-ubyte": (28, 28), "t10k-labels-idx1-ubyte": ()}


def _idx(values: bytes, count: int, shape: tuple[int, ...]) -> bytes:
    dims = (count, *shape)
    return struct.pack(f">i{len(dims)}i", 0x0800 | len(dims), *dims) + values


def _decoded(data: bytes, ndims: int) -> list[int]:
    """The values an IDX file's bytes say it holds (the test's own reading of the format)."""
    return list(data[4 + 4 * ndims:])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.tuples(st.integers(0, 3), st.integers(0, 3)), seed=st.integers(0, 2**32 - 1),
       mutation=st.sampled_from(["none", "flip", "truncate", "append"]), where=st.integers(0, 10**6),
       victim=st.sampled_from(sorted(_MNIST_SHAPES)))
def test_mutated_mnist_files_are_refused_or_load_exactly_what_they_hold(tmp_path, counts, seed, mutation, where,
                                                                       victim):
    """A valid MNIST set with one file mutated: refused in one line, or loaded value for value as written.

    A wrong successful load (labels shifted, pixels from the header, a short file padded) is the bug.
    """
    from convoy.data.mnist import load

    rng, files = random.Random(seed), {}
    for name, shape in _MNIST_SHAPES.items():
        count = counts[name.startswith("t10k")]
        size = count * (28 * 28 if shape else 1)
        files[name] = _idx(bytes(rng.randrange(256 if shape else 10) for _ in range(size)), count, shape)
    data = bytearray(files[victim])
    if mutation == "flip":
        data[where % len(data)] ^= 1 + where % 255
    elif mutation == "truncate":
        del data[where % len(data):]
    elif mutation == "append":
        data += bytes([where % 256])
    files[victim] = bytes(data)
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    try:
        splits = load(str(tmp_path))
    except UsageError as error:
        assert mutation != "none" and "\n" not in str(error) and victim in str(error)
        return
    for split, prefix in ((splits.train, "train"), (splits.test, "t10k")):
        images, labels = split.tensors
        pixels = _decoded(files[f"{prefix}-images-idx3-ubyte"], 3)
        expected = (torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255 - 0.1307) / 0.3081
        torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
        assert labels.tolist() == _decoded(files[f"{prefix}-labels-idx1-ubyte"], 1)


def test_a_gzip_bomb_is_refused_without_reading_it_whole(tmp_path):
    from convoy.data.files import read_bytes

    path = tmp_path / "bomb.gz"
    path.write_bytes(gzip.compress(bytes(4 << 20)))
    with pytest.raises(UsageError, match="decompresses to more than 1 MB"):
        read_bytes(path, limit=1 << 20)
    assert read_bytes(path, limit=4 << 20) == bytes(4 << 20)


def test_simulate_refuses_a_hundred_million_nodes_at_once():
    from convoy.sim.cluster import MAX_NODES, Cluster

    with pytest.raises(UsageError, match=f"at most {MAX_NODES} nodes"):
        Cluster(100_000_000, 1e9)


def test_atomic_save_leaves_the_old_file_or_nothing(tmp_path):
    path = tmp_path / "model.pt"
    save_atomically({"w": torch.arange(3)}, path)
    with pytest.raises(Exception):
        save_atomically({"w": lambda: 0}, path)   # not picklable: fails mid-write
    assert torch.equal(torch.load(path)["w"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    with pytest.raises(UsageError, match="is a directory"):
        save_atomically({}, tmp_path)


@pytest.mark.timeout(120)
def test_workers_die_with_a_sigkilled_parent(tmp_path):
    """The parent-death signal: a child of a SIGKILLed parent ends, whatever it was doing."""
    code = ("import os, subprocess, sys, time\n"
            "from convoy.utils.lifetime import die_with_parent\n"
            "me = os.getpid()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
            "                         preexec_fn=lambda: die_with_parent(me))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _gone_within(child, 15)


@pytest.mark.timeout(60)
def test_a_stop_that_cannot_finish_ends_the_process_within_its_bound():
    """A rank whose stop is stuck (here: asleep, as in a collective with peers that are gone) reports
    the overdue stop and exits 128 + the signal once the bound has passed, not before."""
    code = ("import os, signal, time\n"
            "from convoy.utils.lifetime import StopRequest\n"
            "stop = StopRequest.install(bound_s=1.0, overdue=lambda exc: print('overdue', exc.bound_s, flush=True))\n"
            "stop.defer()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('deferred', stop.signum, flush=True)\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    took = time.monotonic() - start
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["deferred", str(int(signal.SIGTERM)), "overdue", "1.0"]
    assert 1.0 <= took < 30


@pytest.mark.timeout(360)
def test_sigterm_to_the_launcher_stops_every_rank_after_one_step_in_one_line(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "convoy", "train", "--nproc", "2", "--steps", "100000",
                                 "--no-progress", "--out", str(tmp_path / "run")],
                                stderr=subprocess.PIPE, text=True)
    workers = _children_once_training(launcher.pid, tmp_path / "run")
    launcher.send_signal(signal.SIGTERM)
    stderr = launcher.communicate(timeout=60)[1]
    assert launcher.returncode == 128 + signal.SIGTERM
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"convoy: stopped by SIGTERM to the launcher \(pid {launcher.pid}\) at step \d+; no checkpoint "
        r"\(--checkpoint-dir not set\): a new run starts at step 0", lines[0]), stderr
    assert all(_gone_within(pid, 15) for pid in workers)


@pytest.mark.timeout(120)
def test_sigkill_to_the_launcher_leaves_no_worker(tmp_path):
    """SIGKILL cannot be caught or passed on: the kernel ends each worker by the parent-death signal
    the launcher set in it before its program started. Killed as soon as both workers run convoy
    (they are still starting up: the signal is set before exec, so the moment does not matter)."""
    launcher = subprocess.Popen([sys.executable, "-m", "convoy", "train", "--nproc", "2", "--steps", "100000",
                                 "--no-progress", "--out", str(tmp_path / "run")], stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        workers = _workers_running(launcher.pid, 2)
        launcher.kill()
        launcher.wait(timeout=30)
        assert all(_gone_within(pid, 15) for pid in workers)
    finally:   # a worker that outlived the launcher must not outlive the test
        launcher.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _workers_running(pid: int, count: int) -> list[int]:
    """The launcher ``pid``'s ``count`` worker pids, once each runs ``python -m convoy _worker`` (past exec)."""
    deadline = time.monotonic() + 60
    while True:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        started = [int(c) for c in children if b"_worker" in Path(f"/proc/{c}/cmdline").read_bytes()]
        if len(started) == count:
            return started
        assert time.monotonic() < deadline, f"{len(started)} of {count} workers started within 60 s"
        time.sleep(0.02)


_LENET = ["--nproc", "2", "--model", "lenet", "--batch-size", "8", "--steps", "120", "--no-progress"]


@pytest.fixture(scope="module")
def uninterrupted_lenet(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The parameters after an uninterrupted run of the job the stop tests interrupt."""
    run = tmp_path_factory.mktemp("uninterrupted")
    reference = convoy_in_process("train", *_LENET, "--out", str(run))
    assert reference.returncode == 0, reference.stderr
    return saved_model(run)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed, receiver", [
    (0, "rank"),   # rank 1 receives the signal at step 59
    # Rank 0 at step 13: the same path (DivergenceGuard's agreement treats every rank alike).
    pytest.param(1, "rank", marks=pytest.mark.slow),
    # The launcher receives it at step 44 and passes it on to every rank (the graceful stop's other path).
    pytest.param(5, "launcher", marks=pytest.mark.slow),
])
def test_sigterm_to_a_rank_or_the_launcher_commits_the_stop_step_and_the_resumed_run_is_bit_identical(
        tmp_path, seed, receiver, uninterrupted_lenet):
    """Checkpoints every 1000 steps: the only commit is the one the stop forces, at the step every rank
    stopped after; resuming from it ends where an uninterrupted run ends, bit for bit.

    The default run signals rank 1 (not the rank that writes the model file: the agreement must carry
    the stop to rank 0). The slow run (``-m slow``) adds the signal to rank 0 at an earlier step and
    the signal to the launcher, which every rank receives from it.
    """
    rng = random.Random(seed)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1000"]
    job = subprocess.Popen([sys.executable, "-m", "convoy", "train", *_LENET, *ckpt, "--out", str(tmp_path / "a")],
                           stderr=subprocess.PIPE, text=True)
    workers = _children_once_training(job.pid, tmp_path / "a", steps=rng.randrange(5, 60))
    os.kill(workers[rng.randrange(2)] if receiver == "rank" else job.pid, signal.SIGTERM)
    stderr = job.communicate(timeout=240)[1]
    assert job.returncode == 128 + signal.SIGTERM
    who = r"rank [01]" if receiver == "rank" else rf"the launcher \(pid {job.pid}\)"
    stopped = re.fullmatch(rf"convoy: stopped by SIGTERM to {who} at step (\d+); checkpoint committed at step "
                           r"(\d+); resume with the same command", stderr.strip())
    assert stopped and stopped[1] == stopped[2], stderr
    resumed = convoy_in_process("train", *_LENET, *ckpt, "--out", str(tmp_path / "a"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {stopped[1]} (epoch" in resumed.stderr   # the stop step, not an earlier commit
    mine = saved_model(tmp_path / "a")
    assert all(torch.equal(mine[k], uninterrupted_lenet[k]) for k in uninterrupted_lenet)


def test_the_stop_agreement_names_the_ranks_that_received_the_signal():
    from convoy.train.divergence import DivergenceGuard

    guard = DivergenceGuard(None, "")
    assert guard.check(0, 1.0, stop=signal.SIGINT) is None   # read one step later, like the loss flag
    agreed = guard.check(1, 1.0)
    assert agreed.who() == "SIGINT to rank 0"
    assert guard.check(2, 1.0) is None


def _children_once_training(pid: int, run: Path, steps: int = 1) -> list[int]:
    """The launcher's worker pids, once both have written ``steps`` metrics lines (they are past the rendezvous)."""
    deadline = time.monotonic() + 240
    while True:
        files = list(run.glob("metrics-rank*.jsonl"))
        if len(files) == 2 and all(f.read_text().count("\n") >= steps for f in files):
            break
        assert time.monotonic() < deadline, "the workers did not start training within 240 s"
        time.sleep(0.05)
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 2
    return [int(c) for c in children]


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":   # exited, not yet reaped
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------ every subcommand's flags
_PROFILE = {"name": "tiny", "batch_size": 8, "layers": [
    {"name": "conv", "shapes": [[8, 1, 3, 3], [8]], "forward_s": 0.001, "backward_s": 0.002},
    {"name": "fc", "shapes": [[10, 512], [10]], "forward_s": 0.001, "backward_s": 0.002, "head": True}]}
_PATHS = ["", ".", "/", "missing", "missing/deeper", "garbage.json", "list.json", "cluster.toml", "empty",
          "ckpt", "run", "out.pt", "empty/out.pt"]
_ANY = st.one_of(st.sampled_from(["", "0", "-1", "1", "2", "3", "inf", "-inf", "nan", "1e24", "0.5", "1e-300",
                                  str(2**63), "100mbit", "0.5bit", "1gbit", "a,b", "allreduce", "ps", "auto",
                                  "graph", "local", "random"] + _PATHS),
                 st.text(max_size=8), st.integers().map(str), st.floats().map(str))
# Each command: its fixed arguments, the flags fuzzed, and what runs (dry: parsing and the checks that
# come before any process or network namespace starts; full: the whole command, in-process).
_COMMANDS = {
    "simulate": (["simulate", "--profile", "profile.json"],
                 ["--nodes", "--rate", "--racks", "--inter-rack-rate", "--latency-ms", "--wake-ms", "--cores",
                  "--lanes", "--strategy", "--element-fraction", "--blocks-per-layer", "--block-fraction",
                  "--clusters", "--exchange-every", "--servers", "--slice-kb", "--conv-workers", "--fc-workers",
                  "--powersgd-rank", "--batch-size", "--cluster", "--profile"]),
    "plan": (["plan", "cluster.toml", "--profile", "profile.json"],
             ["--top", "--batch-size", "--master-addr", "--master-port", "--steps-to-target", "--profile"]),
    "plan-file": (["plan"], []),   # the cluster file itself fuzzed: the first value is the positional
    "bench": (["bench", "cluster"], ["--hosts", "--rate", "--racks", "--inter-rack-rate"]),
    "profile-nodes": (["profile-nodes"], ["--nproc", "--node-profile", "--clusters", "--indicator-weights",
                                          "--server-choice", "--reelect-every", "--seed"]),
    "inspect": (["checkpoint", "inspect"], []),
    "export": (["checkpoint", "export"], []),
    "plot": (["plot"], ["--out", "--rank"]),
}


def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``convoy ARGV`` in this process: (exit status, stderr). Anything but a UsageError escapes."""
    from convoy.cli.main import main
    from convoy.cli.profile_nodes import check_options

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            if argv[0] == "profile-nodes":   # dry: the checks before any rank starts
                args = build_parser().parse_args(argv)
                check_options(args, args.nproc)
                return 0, err.getvalue()
            return main(argv), err.getvalue()
        except SystemExit as exc:   # argparse's own refusals
            return exc.code, err.getvalue()
        except UsageError as exc:
            print(f"convoy: error: {one_line(str(exc))}", file=sys.stderr)
            return 2, err.getvalue()


def _files(root: Path) -> None:
    (root / "profile.json").write_text(json.dumps(_PROFILE))
    (root / "cluster.toml").write_text('nodes = 2\nrate = "100mbit"\n')
    (root / "garbage.json").write_bytes(b"\x00\xff{[")
    (root / "list.json").write_text("[1, 2]")
    (root / "empty").mkdir(exist_ok=True)
    (root / "ckpt").mkdir(exist_ok=True)
    (root / "ckpt" / "model-rank0.ckpt").write_bytes(b"\x00" * 64)
    (root / "run").mkdir(exist_ok=True)
    (root / "run" / "metrics-rank0.jsonl").write_text('{"kind": "step", "step": 0, "loss": 1.0, "time": 0.1}\n{')


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(_COMMANDS)), st.data())
def test_every_subcommand_fuzzed_exits_0_or_2_in_one_line_writing_nothing_outside(tmp_path, command, data):
    """bench cluster is never given a command to run: it must refuse (bad flags, or no command) before
    building any namespace; profile-nodes runs its checks only (valid flags would start ranks)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    _files(work)
    fixed, flags = _COMMANDS[command]
    positional = {"plan-file": 1, "inspect": 1, "export": 2, "plot": 1}.get(command, 0)
    argv = fixed + [data.draw(_ANY) for _ in range(positional)]
    for flag, value in data.draw(st.lists(st.tuples(st.sampled_from(flags or ["--json"]), _ANY), max_size=3)):
        argv += [flag, value]
    before = set(tmp_path.iterdir())
    cwd = os.getcwd()
    os.chdir(work)
    try:
        code, stderr = _run_cli(argv)
    finally:
        os.chdir(cwd)
    assert code in ((0, 1, 2) if command == "inspect" else (0, 2)), (argv, stderr)
    if code:
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, (argv, stderr)
    assert set(tmp_path.iterdir()) == before
