"""Hierarchical sync on real gloo process groups: 4 ranks, one spawn, several jobs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convoy.cluster import DEFAULT_WEIGHTS, Election, NodeProfile, load_profile_file, make_plan, plan_job
from convoy.compress import FP16Compressor, ResidualMemory, TopKCompressor
from convoy.engine import Engine
from convoy.parallel.groups import cluster_network
from convoy.sync import AllReduce, Hierarchical
from tests.helpers import digits_batches, flat, profile_toml, run_workers, seeded_model

STEPS = 20
LR, MOMENTUM = 0.05, 0.9
# Ranks 0 and 2 are fast, 1 and 3 slow: the clusters are not contiguous ranks.
PROFILE = profile_toml(slow=(1, 3))


def _plan(sizes_first_alone: bool = False, clusters: int = 2, reelect_every: int = 1):
    """A plan from fixed profiles: {0,2} / {1,3}, or {0} / {1,2,3} with ``sizes_first_alone``."""
    slow = (1, 2, 3) if sizes_first_alone else (1, 3)
    profiles = [NodeProfile(r, "h", 3000.0, 16.0, 0.0, 0.0, 400.0, 50.0 if r in slow else 1000.0) for r in range(4)]
    return make_plan(profiles, dict(DEFAULT_WEIGHTS), clusters, seed=0, reelect_every=reelect_every)


def _train(rank: int, world: int, sync, steps: int, same_data: bool = False, check_every_step: bool = False):
    """Train lenet; return final parameters, per-step metrics and, if asked, every rank's parameters per step."""
    model = seeded_model("lenet")
    engine = Engine(model, torch.optim.SGD, sync, listeners=sync.listeners(), lr=LR, momentum=MOMENTUM,
                    weight_decay=1e-4)
    batches = digits_batches(1, 0, 8, steps) if same_data else digits_batches(world, rank, 8, steps)
    snapshots = []
    for x, y in batches:
        engine.backward(F.cross_entropy(model(x), y))
        if check_every_step:
            engine.synchronize()
            everyone = [torch.empty_like(flat(model)) for _ in range(world)]
            dist.all_gather(everyone, flat(model))
            snapshots.append(everyone)
    engine.synchronize()
    metrics = [{**vars(engine.stats(s)), **sync.step_metrics(s)} for s in range(steps)]
    engine.close()
    return flat(model), metrics, snapshots


def _worker(rank: int, world: int, profile_path: str):
    out = {}
    # 1. One cluster against flat all-reduce.
    out["flat"] = _train(rank, world, AllReduce(dist.new_group()), STEPS)[0]
    one = _plan(clusters=1)
    out["one"] = _train(rank, world, Hierarchical(one, exchange_every=3, network=cluster_network(one)), STEPS)[0]
    # 2. The clusters of a profile file, found through the real path (profiling, rank 0, broadcast).
    plan = plan_job(dict(DEFAULT_WEIGHTS), "auto", seed=0, reelect_every=1, overrides=load_profile_file(profile_path))
    out["clusters"] = plan.clusters
    out["servers"] = [plan.servers(c) for c in range(4)]
    # 3. Two clusters, exchange every 2 batches, re-election every cycle: parameters after every batch.
    sync = Hierarchical(plan, exchange_every=2, network=cluster_network(plan))
    out["two"] = _train(rank, world, sync, 8, check_every_step=True)
    # 4. Identical data on every rank: the clusters agree, so the weights are the size shares (1 and 3 nodes).
    alone = _plan(sizes_first_alone=True)
    out["agree"] = _train(rank, world, Hierarchical(alone, exchange_every=2, network=cluster_network(alone)), 6,
                          same_data=True)[1]
    # 5. Composition with compression: summable (fp16) and relayed (top-k) payloads.
    for name, compressor in (("fp16", FP16Compressor()), ("topk", TopKCompressor(0.05))):
        hier = Hierarchical(_plan(), exchange_every=3, compressor=compressor, memory=ResidualMemory(),
                            network=cluster_network(_plan()))
        out[name] = _train(rank, world, hier, 6, check_every_step=True)
    return out


@pytest.mark.timeout(300)
def test_hierarchical_sync_on_four_ranks(tmp_path):
    path = tmp_path / "nodes.toml"
    path.write_text(PROFILE)
    results = run_workers(_worker, 4, str(path))

    # One cluster is flat all-reduce through a server: the same training.
    for r in results:
        assert (r["one"] - r["flat"]).abs().max().item() <= 1e-6

    # The profile's two groups, on every rank; the election is the seeded one and rotates every cycle.
    for r in results:
        assert r["clusters"] == [[0, 2], [1, 3]]
        assert r["servers"] == results[0]["servers"]
    election = Election([[0, 2], [1, 3]], every=1, seed=0)
    assert results[0]["servers"] == [election.servers(c) for c in range(4)]
    servers = results[0]["servers"]
    assert all(servers[c] != servers[c + 1] for c in range(3))   # clusters of two: each cycle a new server

    # Members of a cluster hold identical parameters after every batch; after an exchange, all ranks do.
    _, metrics, snapshots = results[0]["two"]
    for step, everyone in enumerate(snapshots):
        assert torch.equal(everyone[0], everyone[2]) and torch.equal(everyone[1], everyone[3]), step
        if (step + 1) % 2 == 0:
            assert torch.equal(everyone[0], everyone[1]), step
        else:
            assert not torch.equal(everyone[0], everyone[1]), step   # the clusters did train apart
    # Bytes between clusters only from the servers, at exchanges; the server's role moved with the election.
    for step, m in enumerate(metrics):
        assert m["server"] == servers[step // 2][0]
        assert (m["inter_cluster_bytes_sent"] > 0) == ((step + 1) % 2 == 0 and m["server"] == 0), step
        assert m["intra_cluster_bytes_sent"] > 0
        if m.get("exchange"):
            assert min(m["contribution_weights"]) >= 0 and abs(sum(m["contribution_weights"]) - 1) < 1e-12
            assert m["drift"] > 0

    # Clusters that agree get exactly their size shares.
    for r in results:
        exchanges = [m for m in r["agree"] if m.get("exchange")]
        assert len(exchanges) == 3
        for m in exchanges:
            assert m["contribution_weights"] == [0.25, 0.75] or \
                max(abs(a - b) for a, b in zip(m["contribution_weights"], [0.25, 0.75])) < 1e-6
            assert min(m["agreement"]) > 0.999999

    # Compressed gradients still leave each cluster's members identical after every batch.
    for name in ("fp16", "topk"):
        _, metrics, snapshots = results[0][name]
        for everyone in snapshots:
            assert torch.equal(everyone[0], everyone[2]) and torch.equal(everyone[1], everyone[3]), name
        dense = results[0]["two"][1][0]["intra_cluster_bytes_sent"] + results[2]["two"][1][0]["intra_cluster_bytes_sent"]
        assert 0 < metrics[0]["intra_cluster_bytes_sent"] + results[2][name][1][0]["intra_cluster_bytes_sent"] < dense
