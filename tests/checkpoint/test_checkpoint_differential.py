"""Differential checkpoints: SIGKILL a compressed job at random moments, recover by replay, bit for bit.

The job (tests/checkpoint/checkpoint_job.py) exchanges block-sparse gradients with error
feedback and checkpoints every step: a full snapshot every 4 checkpoints, the
averaged sparse update in between. Every trial kills a run inside a log
record's write, inside a layer of a full snapshot, or at a random time; then
the newest step every file holds is restored the way a resume does (snapshot
plus replayed records) and must equal, bit for bit, an uninterrupted run's
parameters and momentum buffers after that step, and its residuals after the
full snapshot the log extends (blocktopk with local selection and
``rank_files="full"``: the rank files are written only with the full
snapshots, and a resume replays the steps since). The next trial resumes from
the same directory.
"""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from convoy.checkpoint import CheckpointSettings, start_checkpointing
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.checkpoint.difflog import CHUNK, BucketUpdate, chunks_of, dense, log_path, pack, unpack
from convoy.checkpoint.recovery import read_updates, replay_updates, restore_model, restore_points, scan, valid_steps
from convoy.checkpoint.schedule import FULL_EVERY_BOUNDS, full_interval
from convoy.checkpoint.store import Store
from convoy.compress import Support
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
    """(step, state by trace key, newest full generation, records replayed, the rank file's step)
    that a resume restores; None before any commit. The state's ``sync:`` entries are the rank
    file's, of the step it holds: the one resumed or (replay) the snapshot the log extends."""
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
            step = max(t for t, p in points.items() if t in rank_reports or p.report.record.step in rank_reports)
            rank_step = step if step in rank_reports else points[step].report.record.step
            torch.manual_seed(0)
            model = lenet()
            states = restore_model(store, points[step].report.area, model)
            states = replay_updates(model, torch.optim.SGD, checkpoint_job.HYPER, states,
                                    read_updates(model_path, points[step]))
            out = {f"param:{k}": v.detach().clone() for k, v in model.named_parameters()}
            for layer, state in states.items():
                out.update({f"momentum:{layer}.{i}": s["momentum_buffer"] for i, s in state.items()})
            rank = rank_store.tensors(rank_reports[rank_step].area, 0)
            out.update({f"sync:{k[len('sync.'):]}": v.clone() for k, v in rank.items() if k.startswith("sync.")})
            del rank
        finally:
            rank_store.close()
        newest = max(r.record.generation for r in reports if r.valid)
        return step, out, newest, len(points[step].updates), rank_step
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


@settings(max_examples=200, deadline=None)
@given(full=st.floats(0.0, 10.0), update=st.floats(0.0, 0.1), step=st.floats(0.01, 5.0), every=st.integers(1, 50),
       budget=st.floats(0.001, 0.5))
def test_the_full_snapshot_interval_is_the_fewest_checkpoints_within_the_budget(full, update, step, every, budget):
    """Within its bounds, the interval chosen is the shortest whose cost per step fits the budget;
    every checkpoint is full (1) only where that costs no more than logging would, and always then."""
    low, high = FULL_EVERY_BOUNDS
    chosen = full_interval(full, update, step, every, budget)

    def cost(k: int) -> float:
        return update + full / (k * every)

    full_alone = full / every
    if chosen == 1:   # no more than logging at the interval the budget asks for, which is in the bounds
        assert full_alone <= cost(low) * (1 + 1e-9)
        return
    assert low <= chosen <= high and full_alone > cost(chosen)
    if low < chosen < high:
        assert cost(chosen) <= budget * step * (1 + 1e-9) and cost(chosen - 1) > budget * step
    if chosen == low and update < budget * step:
        assert cost(low) <= budget * step * (1 + 1e-9)


def test_auto_full_snapshots_measure_then_space_the_snapshots_and_resume_bit_for_bit(tmp_path, trace, capsys):
    """``full_every="auto"``: the first interval is the lower bound, the next one measured; a
    resume from the log of the steps after the first snapshot is still exact."""
    _, session = _train_with_checkpoints(tmp_path, until=15, stop=100, every=1, full_every="auto")
    chosen = session.listener.full_every
    assert FULL_EVERY_BOUNDS[0] <= chosen <= FULL_EVERY_BOUNDS[1]
    assert f"convoy: checkpoint: a full snapshot every {chosen} checkpoints" in capsys.readouterr().err
    # The interval is measured (a loaded machine may choose the lower bound): the rank file holds
    # the first snapshot's step 1 and, if the interval ended before step 15, the next one only.
    fulls = [step for step in range(15) if step >= 1 and (step - 1) % chosen == 0]
    assert set(_rank_steps(tmp_path)) == set(fulls), "a rank file was written between full snapshots"
    state, session = _train_with_checkpoints(tmp_path, until=STEPS, stop=STEPS, every=1, full_every="auto")
    assert (session.start.step, session.start.replay_to) == (fulls[-1], 15), session.start
    for key, tensor in trace[STEPS].items():
        assert torch.equal(state[key], tensor), key


@pytest.mark.parametrize("compress", ["blocktopk", "powersgd"])
def test_auto_full_snapshots_with_checkpoints_steps_apart_decide_at_the_second_and_resume_bit_for_bit(
        tmp_path, compress, capsys):
    """Checkpoints every 3 steps: the first is full, the steps after it logged; at the second the
    writer weighs that log against full snapshots alone and takes the cheaper. Whichever it took,
    a resume reaches the uninterrupted run's state; with no log, from the newest checkpoint alone."""
    _, session = _train_with_checkpoints(tmp_path, until=13, stop=100, compress=compress, every=3,
                                         full_every="auto")
    chosen = session.listener.full_every
    err = capsys.readouterr().err
    assert "convoy: checkpoint: " + ("every checkpoint a full snapshot, no log" if chosen == 1
                                     else f"a full snapshot every {chosen} checkpoints") in err
    state, session = _train_with_checkpoints(tmp_path, until=STEPS, stop=STEPS, compress=compress, every=3,
                                             full_every="auto")
    # Checkpoints after 3, 6, 9 and 12 steps, the first full; the decision came with the second.
    # Without a log, the snapshot after 12 steps alone; with one, the snapshot after 3 and the log
    # (its updates applied, or blocktopk's steps trained again from it: its rank files are full-only).
    if chosen == 1:
        assert session.start.step == 12 and session.start.replay_to is None, session.start
    assert ("replayed" in session.start.notes[0]) == (chosen != 1), session.start
    for key, tensor in checkpoint_job.reference_trace(STEPS, compress)[STEPS].items():
        assert torch.equal(state[key], tensor), key


class _Ranges(Support):
    def __init__(self, starts: np.ndarray, lengths: np.ndarray):
        self.starts, self.lengths = starts, lengths

    def ranges(self) -> tuple[np.ndarray, np.ndarray]:
        return self.starts, self.lengths


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 20 * CHUNK), ranges=st.lists(st.tuples(st.integers(0, 20 * CHUNK), st.integers(1, 3 * CHUNK)),
                                                        max_size=12), seed=st.integers(0, 99))
def test_a_record_read_from_an_exchange_support_round_trips_bit_for_bit(numel, ranges, seed):
    """A gradient that is non-zero only inside a support's (possibly overlapping) ranges: the
    record taken from the support alone rebuilds it exactly, with the runs a scan finds among
    its own (a run the support touches may hold zeros)."""
    ranges = [(start, min(length, numel - start)) for start, length in ranges if start < numel]
    grad = torch.zeros(numel)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    for start, length in ranges:
        grad[start:start + length] = values[start:start + length]
    support = _Ranges(np.array([r[0] for r in ranges], dtype=np.int64), np.array([r[1] for r in ranges], dtype=np.int64))
    encoded = chunks_of(grad, support)
    assert torch.equal(dense(encoded).view(torch.int32), grad.view(torch.int32))
    scanned = chunks_of(grad)
    if scanned.run == CHUNK:
        assert set(scanned.chunks.tolist()) <= set(encoded.chunks.tolist())
    assert encoded.chunks.tolist() == sorted(set(encoded.chunks.tolist()))


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
                step, state, _, replays, rank_step = after
                assert rank_step == step - replays, "a rank file was written between full snapshots"
                for key, tensor in trace[step].items():
                    if key.startswith("sync:"):   # the rank file holds the snapshot's step
                        tensor = trace[rank_step][key]
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


def _train_with_checkpoints(directory: Path, until: int, stop: int, compress: str = COMPRESS, every: int = 3,
                            full_every: int | str = 2, rank_files: str = checkpoint_job.RANK_FILES):
    model, engine, x, y = checkpoint_job.build_job(compress)
    settings = CheckpointSettings(str(directory), every=every, full_every=full_every, rank_files=rank_files)
    session = start_checkpointing(settings, model,
                                  engine, torch.optim.SGD, checkpoint_job.HYPER, total_steps=stop,
                                  steps_per_epoch=checkpoint_job.STEPS_PER_EPOCH)
    checkpoint_job.train(model, engine, x, y, session.start.step, until)
    engine.close()
    session.listener.close()
    return checkpoint_job.state_of(model, engine), session


def _rank_steps(directory: Path) -> dict[int, int]:
    """The rank file's valid steps and the generation of each."""
    store = Store.open(directory / "state-rank0.ckpt")
    try:
        return {step: report.record.generation for step, report in valid_steps(scan(store)).items()}
    finally:
        store.close()


def test_a_resume_between_snapshots_replays_the_steps_since_the_snapshot(tmp_path, trace, capsys):
    """Checkpoints every 3 steps, a full one every other: the rank file holds only the full
    snapshot after step 3; the log reaches step 7 (every step after a snapshot is logged). The
    resume restores the snapshot and trains steps 4-7 again on the log's averages."""
    _train_with_checkpoints(tmp_path, until=7, stop=100)
    assert _rank_steps(tmp_path) == {3: 1}, "the rank file was written between full snapshots"
    state, session = _train_with_checkpoints(tmp_path, until=12, stop=12)
    assert (session.start.step, session.start.replay_to) == (3, 7), session.start
    assert "convoy: checkpoint: resumed from the full snapshot at step 3, replayed 4 steps to step 7" \
        in capsys.readouterr().err
    for key, tensor in trace[12].items():
        assert torch.equal(state[key], tensor), key


@pytest.mark.timeout(600)
def test_a_job_killed_between_full_snapshots_resumes_by_replay_bit_for_bit(tmp_path, trace, capsys):
    """SIGKILLed while writing the log record of step 8 (full snapshots after steps 1 and 5, a
    checkpoint every step): the rank file holds steps 1 and 5 only, each written once. The resume
    restores step 5 and replays 6 and 7; the run then ends as an uninterrupted one, parameters,
    momentum and residuals bit for bit."""
    server = ForkServer(tmp_path / "server.err")
    try:
        status = server.reap(server.run(tmp_path, STEPS, "update:8", 0.0, COMPRESS))
    finally:
        server.close()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (tmp_path / "server.err").read_text()
    assert _rank_steps(tmp_path) == {1: 1, 5: 2}, "the rank file was written between full snapshots"
    state, session = _train_with_checkpoints(tmp_path, until=STEPS, stop=STEPS, every=1,
                                             full_every=checkpoint_job.FULL_EVERY)
    assert (session.start.step, session.start.replay_to) == (5, 7), session.start
    assert "replayed 2 steps to step 7" in capsys.readouterr().err
    for key, tensor in trace[STEPS].items():
        assert torch.equal(state[key], tensor), key


@pytest.mark.parametrize("compress", ["powersgd", "blocktopk-global"])
def test_where_replay_is_not_exact_rank_files_are_written_every_checkpoint(tmp_path, compress):
    """PowerSGD's error uses the all-reduced factors, global block selection the summed scores: a
    rank cannot rebuild its residuals alone, so its file is written at every checkpoint and the
    resume replays only the log's updates from the files."""
    reference = checkpoint_job.reference_trace(12, compress)
    _train_with_checkpoints(tmp_path, until=7, stop=100, compress=compress)
    assert set(_rank_steps(tmp_path)) == {3, 6}
    state, session = _train_with_checkpoints(tmp_path, until=12, stop=12, compress=compress)
    assert (session.start.step, session.start.replay_to) == (6, None), session.start
    assert "3 differential steps replayed" in session.start.notes[-1]   # 4, 5 and 6, from the files
    for key, tensor in reference[12].items():
        assert torch.equal(state[key], tensor), key


def test_by_default_a_local_compressor_s_rank_files_hold_every_checkpoint_and_no_step_is_trained_again(tmp_path):
    """Local blocktopk could rebuild its residuals by replay, but by default (``rank_files="every"``)
    its file is written at every checkpoint, as PowerSGD's, so that a resume on another world
    finds every rank's residuals of the newest step: a resume on the same one starts there too,
    the model file's log applied to the snapshot, and ends as the uninterrupted run, bit for bit."""
    reference = checkpoint_job.reference_trace(12, COMPRESS)
    # Full snapshots after steps 1 and 5, the updates of 6 and 7 logged.
    _train_with_checkpoints(tmp_path, until=7, stop=100, every=1, full_every=4, rank_files="every")
    assert set(_rank_steps(tmp_path)) == {6, 7}, "the rank file was not written at every checkpoint"
    state, session = _train_with_checkpoints(tmp_path, until=12, stop=12, every=1, full_every=4, rank_files="every")
    assert (session.start.step, session.start.replay_to) == (7, None), session.start
    assert "2 differential steps replayed" in session.start.notes[-1]   # the log's updates, from the files
    for key, tensor in reference[12].items():
        assert torch.equal(state[key], tensor), key


def test_replay_is_used_only_where_every_rank_can_rebuild_its_state_alone():
    from convoy.checkpoint.session import replay_ok
    from convoy.engine.gradients import GradientGate

    for compress, expected in [("blocktopk", True), ("topk", True), ("randomk", True), ("powersgd", False),
                               ("blocktopk-global", False), ("fp16", False), ("none", False)]:
        _, engine, _, _ = checkpoint_job.build_job(compress)
        assert replay_ok(engine) is expected, compress
        assert not replay_ok(engine, full_names={"fc.weight": "head.fc.weight"})   # a hybrid part
    _, engine, _, _ = checkpoint_job.build_job("blocktopk")
    engine.gate = GradientGate(1.0, None, None, 1.0)   # --clip-grad-norm: a step needs every layer's exchange
    assert not replay_ok(engine)


def test_a_replayed_exchange_takes_the_logged_average_and_keeps_the_memory_moving():
    from convoy.compress import BlockTopKCompressor, ResidualMemory
    from convoy.sync import AllReduce

    torch.manual_seed(3)
    grads = [torch.randn(4 * CHUNK) for _ in range(2)]
    plain = AllReduce(None, BlockTopKCompressor(1), ResidualMemory())
    replayed = AllReduce(None, BlockTopKCompressor(1), ResidualMemory())
    logged = torch.full((4 * CHUNK,), 0.25)
    replayed.start_replay(lambda step, layers: logged if (step, layers) == (0, ("fc",)) else None)
    shapes = (torch.Size([4 * CHUNK]),)
    first = replayed.start_flat(0, shapes, grads[0].clone(), layers=("fc",)).wait()
    assert first is logged and replayed.traffic() == (0, 0)
    plain.start_flat(0, shapes, grads[0].clone()).wait()
    assert torch.equal(replayed.memory.residuals["0"], plain.memory.residuals["0"])
    # Past the replayed steps the exchange is the usual one.
    assert torch.equal(replayed.start_flat(0, shapes, grads[1].clone(), layers=("fc",)).wait(),
                       plain.start_flat(0, shapes, grads[1].clone()).wait())
