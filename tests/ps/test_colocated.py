"""Colocated parameter servers (``--servers colocated``) on real gloo groups: every rank serves a shard
and trains. Synchronous, they equal all-reduce; compressed pushes train and keep the replicas equal;
a rank's own shard never goes over the network. One spawn of 3 processes serves the assertions."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convoy.compress import BlockTopKCompressor, PowerSGDCompressor, ResidualMemory
from convoy.engine import Engine
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps import PSSettings
from convoy.ps.wire import HEADER_BYTES
from convoy.sync import AllReduce
from tests.helpers import digits_batches, flat, ps_groups, run_workers, seeded_model

WORLD, STEPS, BATCH = 3, 15, 8
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
# Small slices and a tight credit window: lenet's large layer is cut into units across the three
# shards, and those into several slices on two channels.
GRAPH = {"slice_kb": 16, "credit_kb": 40, "channels": 2}
# Rank 2 serves a small share (a host on a slower link): the placement changes, the result must not.
WEIGHTED = GRAPH | {"shard_weights": "1,1,0.2"}
COMPRESSORS = {"blocktopk": lambda: (BlockTopKCompressor(fraction=0.25), ResidualMemory()),
               "powersgd": lambda: (PowerSGDCompressor(rank=2), ResidualMemory())}


def _train_colocated(rank: int, world: int, priority: str, kwargs: dict, compressor: str | None = None):
    settings = PSSettings.resolve(servers="colocated", priority=priority, **kwargs)
    model = seeded_model("lenet")
    compress, memory = COMPRESSORS[compressor]() if compressor else (None, None)
    layout = ParameterServerLayout(model, settings, rank, world, torch.optim.SGD, HYPER,
                                   torch.zeros(BATCH, 1, 32, 32), compressor=compress, memory=memory,
                                   groups=ps_groups(settings, world))
    losses = []
    for x, y in digits_batches(world, layout.data_rank, BATCH, STEPS):
        losses.append(layout.train_step(x, y)[0])
    layout.engine.synchronize()
    layout.server_engine.synchronize()
    stats = layout.engine.stats(STEPS - 1)
    served = layout.step_metrics(STEPS - 1)   # the first call: the server's traffic over the whole run
    layout.engine.close()
    job = layout.job
    mine = set(job.layers_of(rank))
    remote = [u for u in range(len(job.layers)) if u not in mine]
    # What went over the wire in the last step: only the other shards' units, each way.
    pulled = sum(4 * job.numel(u) + HEADER_BYTES * len(job.pull.table[u]) for u in remote)
    # A push is a row: one int64 size per payload tensor (dense: one), then the values.
    pushed = sum(4 * job.numel(u) + 8 + HEADER_BYTES * len(job.push.table[u]) for u in remote)
    # Every step, the server replies with its units to the other ranks and takes in their pushes.
    replied = STEPS * (world - 1) * sum(4 * job.numel(u) + HEADER_BYTES * len(job.pull.table[u]) for u in mine)
    taken = STEPS * (world - 1) * sum(4 * job.numel(u) + 8 + HEADER_BYTES * len(job.push.table[u]) for u in mine)
    return {"params": flat(model), "losses": losses, "units": len(job.layers), "shard": sorted(mine),
            "held": sum(job.numel(u) for u in mine),
            "received": stats.bytes_received, "sent": stats.bytes_sent, "pulled": pulled, "pushed": pushed,
            "served": (served["server_bytes_sent"], served["server_bytes_received"]), "replied": (replied, taken)}


def _train_allreduce(rank: int, world: int):
    model = seeded_model("lenet")
    engine = Engine(model, torch.optim.SGD, AllReduce(dist.new_group()), **HYPER)
    for x, y in digits_batches(world, rank, BATCH, STEPS):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    engine.close()
    return flat(model)


def _job(rank: int, world: int):
    return {"allreduce": _train_allreduce(rank, world),
            "graph": _train_colocated(rank, world, "graph", GRAPH),
            "fifo": _train_colocated(rank, world, "fifo", {}),
            "weighted": _train_colocated(rank, world, "graph", WEIGHTED),
            **{name: _train_colocated(rank, world, "graph", GRAPH, name) for name in COMPRESSORS}}


@pytest.fixture(scope="module")
def job():
    return run_workers(_job, WORLD)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["graph", "fifo", "weighted"])
def test_colocated_staleness_0_equals_allreduce_after_15_steps(job, run):
    reference = job[0]["allreduce"]
    assert (reference - flat(seeded_model("lenet"))).abs().max().item() > 1e-3   # it trained
    for rank in range(WORLD):
        assert (job[rank][run]["params"] - reference).abs().max().item() <= 1e-5, (rank, run)


@pytest.mark.timeout(600)
def test_shard_weights_give_a_rank_its_share_and_still_every_unit_one_owner(job):
    held = [job[rank]["weighted"]["held"] for rank in range(WORLD)]
    even = [job[rank]["graph"]["held"] for rank in range(WORLD)]
    assert sum(held) == sum(even)
    assert held[2] < 0.25 * min(held[:2]) and held[2] < 0.5 * even[2], held   # asked: 0.2 of the others'
    shards = [job[rank]["weighted"]["shard"] for rank in range(WORLD)]
    assert sorted(u for shard in shards for u in shard) == list(range(job[0]["weighted"]["units"]))
    for rank in range(WORLD):
        run = job[rank]["weighted"]
        assert run["received"] == run["pulled"] and run["sent"] == run["pushed"], rank


@pytest.mark.timeout(600)
def test_every_rank_serves_a_shard_of_cut_layers_and_its_own_shard_stays_off_the_wire(job):
    shards = [job[rank]["graph"]["shard"] for rank in range(WORLD)]
    units = job[0]["graph"]["units"]
    assert units > 10   # lenet's 5 layers, the large ones cut into rows
    assert sorted(u for shard in shards for u in shard) == list(range(units))   # each unit on one rank
    assert all(shards)
    for rank in range(WORLD):
        run = job[rank]["graph"]
        assert run["received"] == run["pulled"] and run["sent"] == run["pushed"], rank
        # The rank's server's traffic is in its metrics too: its link carries the replies beside the pushes.
        for name in ("graph", "fifo", "weighted"):
            assert job[rank][name]["served"] == job[rank][name]["replied"], (rank, name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_compressed_pushes_train_and_keep_every_replica_equal(job, compressor):
    runs = [job[rank][compressor] for rank in range(WORLD)]
    for run in runs[1:]:
        assert torch.equal(run["params"], runs[0]["params"])   # every rank pulled the same parameters
    assert (runs[0]["params"] - job[0]["graph"]["params"]).abs().max().item() > 1e-4   # compression changed it
    losses = runs[0]["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5   # and it trained
    dense = job[0]["graph"]
    assert runs[0]["sent"] < dense["sent"]   # pushes are smaller than dense rows
