"""Crash safety: SIGKILL a checkpointing training process at random moments, then recover.

A fork server (tests/checkpoint_job.py) keeps each run cheap. Every trial
kills a run inside a layer's write, inside a commit record's write (fault
injection points), or at a random time while the persister is slowed; then
the newest step committed in both files is read back and must equal, bit for
bit, the state an uninterrupted run had after that step. The next trial
resumes from the same directory, so the chain also checks resume after crashes.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convoy.checkpoint.recovery import scan, state_dict_of, valid_steps
from convoy.checkpoint.store import Store

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import checkpoint_job  # noqa: E402

STEPS = 40
TRIALS = 36


class ForkServer:
    def __init__(self, stderr_path: Path):
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "checkpoint_job.py"), "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()[1]

    def run(self, directory: Path, kill: str = "-", delay: float = 0.0) -> int:
        return int(self._ask(f"run {directory} {STEPS} {kill} {delay}"))

    def reap(self, pid: int) -> int:
        return int(self._ask(f"reap {pid}"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._stderr.close()


@pytest.fixture(scope="module")
def trace():
    return checkpoint_job.reference_trace(STEPS)


def recovered(directory: Path):
    """(step, parameters, optimizer states) of the newest step valid in both files; None before any commit."""
    model_path, rank_path = directory / "model-rank0.ckpt", directory / "state-rank0.ckpt"
    if not model_path.exists():
        return None
    store = Store.open(model_path)
    try:
        reports = scan(store, store.layout.signature())
        if all(r.empty for r in reports):
            return None
        rank_store = Store.open(rank_path)
        rank_steps = valid_steps(scan(rank_store))
        rank_store.close()
        steps = set(valid_steps(reports)) & set(rank_steps)
        assert steps, [r.describe() for r in reports]
        step = max(steps)
        params, states = state_dict_of(store, valid_steps(reports)[step].area)
        return step, params, states
    finally:
        store.close()


def assert_matches_trace(result, trace) -> None:
    step, params, states = result
    expected = trace[step]
    for key, tensor in expected.items():
        kind, name = key.split(":", 1)
        if kind == "param":
            got = params[name]
        else:
            layer, index = name.rsplit(".", 1)
            got = states[layer][int(index)]["momentum_buffer"]
        assert torch.equal(got, tensor), f"step {step}: {key} differs from the uninterrupted run"


def test_sigkill_at_random_moments_always_recovers_a_bit_identical_step(tmp_path, trace):
    rng = random.Random(20261122)
    server = ForkServer(tmp_path / "server.err")
    kinds = {"slot": 0, "record": 0, "random": 0}
    chain, directory, progress = 0, None, []
    try:
        for trial in range(TRIALS):
            if directory is None:
                chain += 1
                directory = tmp_path / f"chain{chain}"
            before = recovered(directory)
            committed = before[0] if before else 0   # generation == step with a checkpoint every step
            kind = ("slot", "record", "random")[trial % 3]
            if kind == "slot":
                pid = server.run(directory, f"slot:{committed + rng.randint(1, 3)}:{rng.randrange(5)}")
            elif kind == "record":
                pid = server.run(directory, f"record:{committed + rng.randint(1, 3)}")
            else:
                pid = server.run(directory, delay=0.002)
                time.sleep(rng.uniform(0.0, 0.5))
                os.kill(pid, signal.SIGKILL)
            status = server.reap(pid)
            after = recovered(directory)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            assert killed or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), \
                (tmp_path / "server.err").read_text()
            if after is not None:
                assert_matches_trace(after, trace)
                assert after[0] >= committed, "a kill lost an already committed step"
            if killed:
                kinds[kind] += 1
            progress.append((kind, committed, after[0] if after else 0, killed))
            if after is not None and after[0] == STEPS:
                directory = None
    finally:
        server.close()
    assert sum(kinds.values()) >= 30, (kinds, progress)
    assert kinds["slot"] >= 10 and kinds["record"] >= 10, (kinds, progress)
