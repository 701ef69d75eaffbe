"""Differential checkpoints: SIGKILL a compressed job at random moments, recover by replay, bit for bit.

The job (tests/checkpoint/checkpoint_job.py) exchanges block-sparse gradients with error
feedback and checkpoints every step: a full snapshot every 4 checkpoints, the
averaged sparse update in between. Every trial kills a run inside a log
record's write, inside a layer of a full snapshot, or at a random time; then
the newest step every file holds is restored the way a resume does (snapshot
plus replayed records) and must equal, bit for bit, an uninterrupted run's
parameters, momentum buffers and residuals after that step. The next trial
resumes from the same directory.
"""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from convoy.checkpoint import CheckpointSettings, start_checkpointing
from convoy.checkpoint.difflog import CHUNK, BucketUpdate, chunks_of, dense, log_path, pack, unpack
from convoy.checkpoint.recovery import read_updates, replay_updates, restore_model, restore_points, scan, valid_steps
from convoy.checkpoint.store import Store
from convoy.models.lenet import lenet
from tests.checkpoint import checkpoint_job
from tests.checkpoint.checkpoint_job import ForkServer

STEPS = 24
TRIALS = 18
COMPRESS = "blocktopk"


@pytest.fixture(scope="module")
def trace():
    return checkpoint_job.reference_trace(STEPS, COMPRESS)


def recovered(directory: Path):
    """(step, state by trace key, newest full generation) that a resume restores; None before any commit."""
    model_path, rank_path = directory / "model-rank0.ckpt", directory / "state-rank0.ckpt"
    if not model_path.exists():
        return None
    store = Store.open(model_path)
    try:
        reports = scan(store, store.layout.signature())
        if all(r.empty for r in reports):
            return None
        rank_store = Store.open(rank_path)
        try:
            rank_reports = valid_steps(scan(rank_store))
            points = restore_points(model_path, reports)
            step = max(set(points) & set(rank_reports))
            torch.manual_seed(0)
            model = lenet()
            states = restore_model(store, points[step].report.area, model)
            states = replay_updates(model, torch.optim.SGD, checkpoint_job.HYPER, states,
                                    read_updates(model_path, points[step]))
            out = {f"param:{k}": v.detach().clone() for k, v in model.named_parameters()}
            for layer, state in states.items():
                out.update({f"momentum:{layer}.{i}": s["momentum_buffer"] for i, s in state.items()})
            rank = rank_store.tensors(rank_reports[step].area, 0)
            out.update({f"sync:{k[len('sync.'):]}": v.clone() for k, v in rank.items() if k.startswith("sync.")})
            del rank
        finally:
            rank_store.close()
        newest = max(r.record.generation for r in reports if r.valid)
        return step, out, newest, len(points[step].updates)
    finally:
        store.close()


def test_updates_round_trip_bit_for_bit_negative_zero_included():
    grad = torch.zeros(5 * CHUNK + 7)
    grad[CHUNK:2 * CHUNK] = torch.randn(CHUNK)   # whole runs, as block-sparse updates fill them
    grad[3 * CHUNK:4 * CHUNK] = torch.randn(CHUNK)
    grad[3 * CHUNK + 2] = -0.0
    grad[-2] = 1.5
    view = torch.zeros(1 + grad.numel())[1:]   # an odd offset: the bits cannot pair into 64-bit words
    view.copy_(grad)
    for source in (grad, view, grad.double(), grad.half()):
        encoded = chunks_of(source)
        assert encoded.chunks.tolist() == [1, 3]
        payload = b"".join(bytes(part) for part in pack(7, [BucketUpdate(["fc"], {"lr": 0.1}, encoded)], ["bn"]))
        decoded = unpack(payload)
        assert decoded["step"] == 7 and decoded["skipped"] == ["bn"]
        (bucket,) = decoded["buckets"]
        assert bucket.layers == ["fc"] and bucket.hyper == {"lr": 0.1}
        back = dense(bucket.grad)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[source.element_size()]
        assert torch.equal(back.view(bits), source.view(bits))


def test_scattered_elements_are_kept_as_positions_and_round_trip():
    grad = torch.zeros(64 * CHUNK)
    grad[::CHUNK // 2] = torch.randn(2 * 64)   # every run holds two elements: positions are fewer bytes
    grad[5] = -0.0
    encoded = chunks_of(grad)
    assert encoded.run == 1 and len(encoded.chunks) == 2 * 64 + 1
    (bucket,) = unpack(b"".join(bytes(p) for p in pack(3, [BucketUpdate(["fc"], {}, encoded)], [])))["buckets"]
    assert torch.equal(dense(bucket.grad).view(torch.int32), grad.view(torch.int32))


@pytest.mark.timeout(900)
def test_sigkill_with_differential_checkpoints_recovers_a_bit_identical_step(tmp_path, trace):
    rng = random.Random(20261125)
    server = ForkServer(tmp_path / "server.err")
    kinds = {"update": 0, "slot": 0, "random": 0}
    chain, directory, progress, replayed = 0, None, [], 0
    try:
        for trial in range(TRIALS):
            if directory is None:
                chain += 1
                directory = tmp_path / f"chain{chain}"
            before = recovered(directory)
            committed, generation = (before[0], before[2]) if before else (0, 0)
            kind = ("update", "slot", "random")[trial % 3]
            if kind == "update":
                kill = f"update:{committed + rng.randint(2, 4)}"
            elif kind == "slot":
                kill = f"slot:{generation + rng.randint(1, 2)}:{rng.randrange(5)}"
            else:
                kill = "-"
            pid = server.run(directory, STEPS, kill, 0.002 if kind == "random" else 0.0, COMPRESS)
            if kind == "random":
                time.sleep(rng.uniform(0.0, 0.5))
                os.kill(pid, signal.SIGKILL)
            status = server.reap(pid)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            assert killed or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), \
                (tmp_path / "server.err").read_text()
            after = recovered(directory)
            if after is not None:
                step, state, _, replays = after
                for key, tensor in trace[step].items():
                    assert torch.equal(state[key], tensor), f"step {step}: {key} differs from the uninterrupted run"
                assert step >= committed, "a kill lost an already committed step"
                replayed += replays > 0
            kinds[kind] += killed
            progress.append((kind, committed, after[0] if after else 0, killed))
            if after is not None and after[0] == STEPS:
                directory = None
    finally:
        server.close()
    assert kinds["update"] >= 4 and kinds["slot"] >= 3, (kinds, progress)
    assert replayed >= 5, ("too few recoveries went through a replay", progress)
    assert any(log_path(tmp_path / f"chain{c}" / "model-rank0.ckpt", 0).exists() for c in range(1, chain + 1))


def _train_with_checkpoints(directory: Path, start_expected: int | None, until: int, stop: int):
    model, engine, x, y = checkpoint_job.build_job(COMPRESS)
    session = start_checkpointing(CheckpointSettings(str(directory), every=3, full_every=2), model, engine,
                                  torch.optim.SGD, checkpoint_job.HYPER, total_steps=stop,
                                  steps_per_epoch=checkpoint_job.STEPS_PER_EPOCH)
    if start_expected is not None:
        assert session.start.step == start_expected, session.start
    checkpoint_job.train(model, engine, x, y, session.start.step, until)
    engine.close()
    session.listener.close()
    return checkpoint_job.state_of(model, engine), session


def test_a_checkpoint_between_snapshots_replays_every_step_since_the_snapshot(tmp_path, trace):
    """Checkpoints every 3 steps, a full one every other: the checkpoint after step 6 is the
    snapshot after step 3 plus the updates of steps 4, 5 and 6, all replayed on resume."""
    _train_with_checkpoints(tmp_path, None, until=7, stop=100)
    state, session = _train_with_checkpoints(tmp_path, 6, until=12, stop=12)
    assert "3 differential steps replayed" in session.start.notes[-1]
    for key, tensor in trace[12].items():
        assert torch.equal(state[key], tensor), key
