"""Crash safety: SIGKILL a checkpointing training process at random moments, then recover.

A fork server (tests/checkpoint/checkpoint_job.py) keeps each run cheap. Every trial
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
import time

import pytest

from tests.checkpoint import checkpoint_job
from tests.checkpoint.checkpoint_job import ForkServer, assert_matches_trace, recovered

STEPS = 40
TRIALS = 36


@pytest.fixture(scope="module")
def trace():
    return checkpoint_job.reference_trace(STEPS)


@pytest.mark.timeout(600)
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
                pid = server.run(directory, STEPS, f"slot:{committed + rng.randint(1, 3)}:{rng.randrange(5)}")
            elif kind == "record":
                pid = server.run(directory, STEPS, f"record:{committed + rng.randint(1, 3)}")
            else:
                pid = server.run(directory, STEPS, delay=0.002)
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
