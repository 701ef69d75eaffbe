"""Parameter-server training on real gloo groups: equality with all-reduce, scheduling order,
the Chrome trace, and a dead server. One spawn of 4 processes serves most assertions."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convoy.compress import BlockTopKCompressor, ResidualMemory
from convoy.engine import Engine
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps import PSSettings
from convoy.ps.scheduler import SliceScheduler, Transfer
from convoy.ps.wire import ACK_TAG, HEADER_BYTES, HEADER_TAG, payload_tag
from convoy.sync import AllReduce
from tests.helpers import digits_batches, flat, free_port, ps_groups, run_workers, seeded_model

WORLD, STEPS, BATCH = 4, 20, 4
LR, MOMENTUM, WD = 0.05, 0.9, 1e-4
HYPER = {"lr": LR, "momentum": MOMENTUM, "weight_decay": WD}
# Every priority mode, with slices small enough that lenet's layers are cut
# into several and credit windows that hold back most of them.
MODES = [("fifo", {}), ("graph", {"slice_kb": 16, "credit_kb": 40, "channels": 2}),
         ("timed", {"slice_kb": 7, "channels": 3})]
TRACED = (2, "graph")
SLICE = 16 * 1024   # scheduler test: bytes per slice, and the credit window


def _batches(world: int, rank: int) -> list:
    """This worker's share of the first STEPS global batches of digits."""
    return digits_batches(world, rank, BATCH, STEPS)


def _sparse():
    """A compressor whose payloads differ between ranks (gathered, not summed), with error feedback."""
    return BlockTopKCompressor(fraction=0.25), ResidualMemory()


def _train_ps(rank: int, world: int, servers: int, mode: str, kwargs: dict, trace_dir: str | None,
              compressed: bool = False):
    settings = PSSettings.resolve(servers=servers, priority=mode, trace_steps=2 if trace_dir else 0, **kwargs)
    model = seeded_model("lenet")
    compressor, memory = _sparse() if compressed else (None, None)
    layout = ParameterServerLayout(model, settings, rank, world, torch.optim.SGD, HYPER, torch.zeros(BATCH, 1, 32, 32),
                                   compressor=compressor, memory=memory, groups=ps_groups(settings, world))
    for x, y in _batches(world - servers, layout.data_rank):
        layout.train_step(x, y)
    layout.engine.synchronize()
    stats = layout.engine.stats(STEPS - 1)
    layout.engine.close()
    if trace_dir:
        layout.save_trace(Path(trace_dir))
    state = layout.full_state_dict()
    if not layout.is_server and not compressed:   # what went over the wire in the last step
        params = 4 * sum(p.numel() for p in model.parameters())
        pulled = params + HEADER_BYTES * sum(len(p) for p in layout.job.pull.table)
        # A push is a row: one int64 size per payload tensor (dense: one), then the values.
        pushed = params + 8 * len(layout.job.layers) + HEADER_BYTES * sum(len(p) for p in layout.job.push.table)
        return stats.bytes_received == pulled and stats.bytes_sent == pushed
    return None if state is None else torch.cat([t.reshape(-1) for t in state.values()])


def _train_allreduce(rank: int, servers: int, world: int, compressed: bool = False):
    workers = list(range(servers, world))
    group = dist.new_group(workers)   # every rank takes part in creating it
    if rank not in workers:
        return None
    model = seeded_model("lenet")
    engine = Engine(model, torch.optim.SGD, AllReduce(group, *(_sparse() if compressed else ())), **HYPER)
    for x, y in _batches(len(workers), rank - servers):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    engine.close()
    return flat(model)


def _scheduler_order(rank: int, group) -> list[int]:
    """Rank 0 sends a low-priority tensor in 4 slices; a 2-slice high-priority one becomes
    ready while the second low slice is in flight, with the next step's most urgent slice.
    Rank 1 holds its receives back until then."""
    low = [torch.full((SLICE // 4,), float(i)) for i in range(4)]
    high = [torch.full((SLICE // 4,), 10.0 + i) for i in range(2)]
    if rank == 0:
        scheduler = SliceScheduler(credit_bytes=SLICE, record=True)
        scheduler.submit(Transfer(1, group, 0, i, 0, t, (5, i)) for i, t in enumerate(low))
        while len(scheduler.issued) < 2:      # low 0 sent; low 1 issued, waiting for rank 1
            time.sleep(0.01)
        scheduler.submit([Transfer(1, group, 0, 20, 1, torch.full((SLICE // 4,), 20.0), (0, 0))]
                         + [Transfer(1, group, 0, 10 + i, 0, t, (1, i)) for i, t in enumerate(high)])
        dist.send(torch.zeros(1), 1, group=group, tag=9)
        scheduler.close()
        return [t.slice_id for t in scheduler.issued]
    received = []
    for i in range(7):
        if i == 1:
            dist.recv(torch.zeros(1), 0, group=group, tag=9)   # the high slices are queued now
        received.append(_receive_slice(group))
    return received


def _receive_slice(group) -> int:
    """Rank 1: the next slice from rank 0 (its header, then its payload, which holds its id)."""
    head, payload = torch.empty(2, dtype=torch.int64), torch.empty(SLICE // 4)
    dist.recv(head, 0, group=group, tag=HEADER_TAG)
    dist.recv(payload, 0, group=group, tag=payload_tag(int(head[0])))
    assert payload[0].item() == head[0].item()
    return int(head[0])


def _acked_credit(rank: int, group) -> tuple[list[int], list[int]] | None:
    """Rank 0 sends two slices with credit for one, acknowledged; rank 1 takes the first and holds
    its acknowledgement back. Rank 0's slices issued meanwhile, and in the end."""
    if rank == 0:
        scheduler = SliceScheduler(credit_bytes=SLICE, acked=True, record=True)
        scheduler.submit(Transfer(1, group, 0, i, 0, torch.full((SLICE // 4,), float(i)), (0, i), ack_group=group)
                         for i in range(2))
        dist.recv(torch.zeros(1), 1, group=group, tag=9)   # the first slice is in, not acknowledged
        time.sleep(0.3)   # time enough to issue the second, were its credit back
        meanwhile = [t.slice_id for t in scheduler.issued]
        dist.send(torch.zeros(1), 1, group=group, tag=10)
        scheduler.close()
        return meanwhile, [t.slice_id for t in scheduler.issued]
    if rank == 1:
        _receive_slice(group)
        dist.send(torch.zeros(1), 0, group=group, tag=9)
        dist.recv(torch.zeros(1), 0, group=group, tag=10)
        dist.send(torch.zeros(1, dtype=torch.int64), 0, group=group, tag=ACK_TAG)
        _receive_slice(group)
        dist.send(torch.zeros(1, dtype=torch.int64), 0, group=group, tag=ACK_TAG)
    return None


def _job(rank: int, world: int, out_dir: str):
    results = {}
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        results["scheduler"] = _scheduler_order(rank, pair)
        results["acked"] = _acked_credit(rank, pair)
    for servers in (1, 2):
        for mode, kwargs in MODES:
            traced = (servers, mode) == TRACED
            results[(servers, mode)] = _train_ps(rank, world, servers, mode, kwargs, out_dir if traced else None)
        results[(servers, "allreduce")] = _train_allreduce(rank, servers, world)
    results["ps-blocktopk"] = _train_ps(rank, world, 1, "graph", MODES[1][1], None, compressed=True)
    results["allreduce-blocktopk"] = _train_allreduce(rank, 1, world, compressed=True)
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ps-trace")
    return run_workers(_job, WORLD, str(out_dir)), out_dir


@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers", [1, 2])
def test_ps_equals_data_parallel_allreduce(job, servers):
    results, _ = job
    reference = results[servers][(servers, "allreduce")]   # the first worker's parameters
    for mode, _ in MODES:
        ps = results[0][(servers, mode)]        # rank 0's full state
        assert (ps - reference).abs().max().item() <= 1e-5, (servers, mode)
    assert (reference - flat(seeded_model("lenet"))).abs().max().item() > 1e-3   # it trained
    for worker in range(servers, WORLD):   # each worker pushed and pulled every slice once
        assert all(results[worker][(servers, mode)] is True for mode, _ in MODES)


@pytest.mark.timeout(600)
def test_compressed_pushes_equal_allreduce_with_the_same_compressor(job):
    """Pushes go through the same compressor and error-feedback memory as all-reduce, and the server
    sums the workers' decoded rows in worker order as all-reduce's gather does: the same training."""
    results, _ = job
    reference = results[1]["allreduce-blocktopk"]
    assert (results[0]["ps-blocktopk"] - reference).abs().max().item() <= 1e-5
    assert (reference - results[1][(1, "allreduce")]).abs().max().item() > 1e-4   # compression changed it


@pytest.mark.timeout(600)
def test_scheduler_sends_by_priority_and_preempts_at_slice_boundaries(job):
    results, _ = job
    # Low 1 was in flight: finished, not taken back. The next step's slice, however urgent, goes after
    # this step's (a colocated rank's pushes of step t+1 must not hold back its replies of step t).
    expected = [0, 1, 10, 11, 2, 3, 20]
    assert results[0]["scheduler"] == expected
    assert results[1]["scheduler"] == expected


@pytest.mark.timeout(600)
def test_acknowledged_credit_comes_back_only_when_the_receiver_has_the_slice(job):
    """A send completes once the kernel holds its bytes; acknowledged credit waits for the receiver."""
    results, _ = job
    meanwhile, issued = results[0]["acked"]
    assert meanwhile == [0]
    assert issued == [0, 1]


@pytest.mark.timeout(600)
def test_trace_shows_compute_updates_and_every_slice_on_its_channel(job, capsys):
    from convoy.cli.main import main

    _, out_dir = job
    assert main(["trace", str(out_dir)]) == 0
    assert "trace.json" in capsys.readouterr().out
    events = json.loads((out_dir / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    by_cat = {cat: [e for e in spans if e["cat"] == cat] for cat in ("compute", "push", "pull", "update")}
    assert all(by_cat.values()), {k: len(v) for k, v in by_cat.items()}
    workers = {e["pid"] for e in by_cat["compute"]}
    assert workers == {2, 3}
    assert {e["name"] for e in by_cat["compute"]} >= {"features.0", "classifier.5"}
    pull_tracks = {tracks[(e["pid"], e["tid"])] for e in by_cat["pull"]}
    assert any("ch1" in t for t in pull_tracks) and any("ch0" in t for t in pull_tracks)  # both channels used
    assert {e["args"]["step"] for e in spans} <= {1, 2, 3}


@pytest.mark.timeout(600)
def test_a_dead_server_stops_every_worker_with_a_clear_error(tmp_path):
    port = str(free_port())
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "convoy", "train", "--sync", "ps", "--servers", "1", "--steps", "100000",
             "--batch-size", "8", "--no-progress", "--timeout", "60", "--out", str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        metrics = tmp_path / "metrics-rank1.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                # Kill before reading: communicate() on a live process would wait for its 100000 steps.
                for p in procs:
                    p.kill()
                pytest.fail("the job did not reach step 3 in 180 s or a rank exited early: "
                            + " | ".join(p.communicate()[1][-1500:] for p in procs))
            time.sleep(0.1)
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for worker in procs[1:]:
            _, err = worker.communicate(timeout=30)
            assert worker.returncode not in (0, None)
            assert "convoy: error: rank" in err and "parameter server" in err and "rank 0" in err, err[-2000:]
        assert time.monotonic() - killed < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
