"""The scaling simulator: closed-form collectives, the engine's overlap, byte counts, profiles, the CLI."""
from __future__ import annotations

import json
import math

import pytest

from convoy.cli.main import main
from convoy.compress import DEFAULT_POWERSGD_RANK
from convoy.errors import UsageError
from convoy.sim import threads
from convoy.sim.cluster import Cluster, load_cluster
from convoy.sim.codec import Compression
from convoy.sim.network import Link, ring_allgather, ring_allreduce, via_server
from convoy.sim.overlap import Transfer, simulate
from convoy.sim.profile import LayerProfile, ModelProfile, load_profile, profile_model
from convoy.sim.strategies import ClusterCycles, ConvFcSplit, LayerRing, ServerShards, TorchDDP
from convoy.sim.strategies.ps import Message, schedule
from convoy.sync.allreduce import ring_allreduce_bytes


@pytest.fixture(scope="module")
def lenet():
    return profile_model("lenet", batch_size=8, repeats=2)


def toy(compute: float = 0.01, params: int = 1_000_000) -> ModelProfile:
    """Two small conv layers and an FC head of ``params``; ``compute`` s forward per layer, 2x backward."""
    shapes = [((params // 1000, 10, 10),), ((params // 1000, 10, 10),), ((1000, params // 1000), (1000,))]
    layers = tuple(LayerProfile(f"l{i}", s, compute, 2 * compute, compute / 10, head=i == 2)
                   for i, s in enumerate(shapes))
    return ModelProfile("toy", layers, batch_size=16, activation_bytes=400)


# ----------------------------------------------------------------- network
def test_ring_allreduce_is_the_bandwidth_optimal_closed_form():
    link = Link(bytes_per_s=12.5e6, latency_s=0.0)
    assert ring_allreduce(10e6, 4, link) == pytest.approx(2 * 3 / 4 * 10e6 / 12.5e6)   # 1.2 s
    assert ring_allreduce(10e6, 1, link) == 0.0
    with_latency = Link(12.5e6, latency_s=1e-3)
    assert ring_allreduce(10e6, 4, with_latency) == pytest.approx(1.2 + 2 * 3 * 1e-3)
    assert ring_allgather(1e6, 4, link) == pytest.approx(3 * 1e6 / 12.5e6)
    assert via_server(1e6, 4, link) == pytest.approx(3 * 1e6 / 12.5e6)


def test_wake_up_shows_on_small_messages_and_hides_behind_large_ones():
    link = Link(bytes_per_s=12.5e6, wake_s=3e-3)
    assert link.transfer(1_000) == pytest.approx(3e-3)            # 80 us of bytes: the wake-up counts
    assert link.transfer(1e6) == pytest.approx(1e6 / 12.5e6)       # 80 ms of bytes: it is hidden
    assert ring_allreduce(4_000, 4, link) == pytest.approx(6 * 3e-3)
    assert ring_allreduce(10e6, 4, link) == pytest.approx(1.2)
    assert via_server(1e6, 4, Link(12.5e6, latency_s=1e-3, wake_s=1.0)) == pytest.approx(1e-3 + 1.0)
    with pytest.raises(UsageError):
        Link(12.5e6, wake_s=-1e-3)


def test_calibration_allreduce_within_five_percent_of_the_emulated_cluster():
    # bench/results/cluster_allreduce_100mbit_4.json: 10 MB over 4 hosts at 100 Mbit took 1.283 s.
    predicted = ring_allreduce(10e6, 4, Cluster(4, 100e6).ring_link())
    assert predicted == pytest.approx(1.283, rel=0.05)
    assert predicted > 1.2   # TCP/IP framing: slower than the payload-only bound


@pytest.mark.parametrize("bad", [0.0, -1e6])
def test_zero_or_negative_bandwidth_is_an_error(bad):
    with pytest.raises(UsageError):
        Link(bad)
    with pytest.raises(UsageError):
        Link.from_bits(bad)
    with pytest.raises(UsageError):
        Cluster(4, bad)
    with pytest.raises(UsageError):
        Cluster(4, 1e9, racks=2, inter_rack_bps=bad)


def test_racks_make_the_inter_rack_link_the_ring_bottleneck():
    flat, racked = Cluster(4, 1e9), Cluster(4, 1e9, racks=2, inter_rack_bps=1e8)
    assert racked.ring_link().bytes_per_s == pytest.approx(flat.ring_link().bytes_per_s / 10)


# ----------------------------------------------------------------- overlap
def test_perfect_overlap_step_equals_compute():
    # Late layers' exchanges hide behind the backward of earlier ones; layer 0's is free.
    fwd, bwd = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    t = simulate(fwd, bwd, [0, 0, 0], [Transfer((2,), 1.5), Transfer((1,), 1.5), Transfer((0,), 0.0)])
    assert t.step_s == pytest.approx(9.0)
    assert t.forward_wait_s == pytest.approx(0.0)


def test_exposed_communication_closed_forms():
    fwd, bwd = [1.0, 1.0], [2.0, 2.0]
    # Layer 0's exchange is always exposed: the next forward needs it first.
    assert simulate(fwd, bwd, [0, 0], [Transfer((1,), 0.5), Transfer((0,), 0.5)]).step_s == pytest.approx(6.5)
    # Communication-bound: forward 0, forward 1, backward 1, then both exchanges in a row.
    assert simulate(fwd, bwd, [0, 0], [Transfer((1,), 5), Transfer((0,), 5)]).step_s == pytest.approx(14.0)
    # torch DDP: compute, then the one bucket's all-reduce, then the update.
    assert simulate(fwd, bwd, [0.5, 0.5], [Transfer((0, 1), 5)], barrier=True).step_s == pytest.approx(12.0)


def test_layerwise_updates_hide_where_a_barrier_pays_them_all():
    # Layer 0 is exchanged last in both, so only the updates differ: the engine
    # applies each as its exchange ends (only layer 0's is in the way), DDP all after.
    fwd, bwd, upd = [1.0] * 4, [2.0] * 4, [0.5] * 4
    exchanges = [Transfer((i,), 1.0) for i in reversed(range(4))]
    assert simulate(fwd, bwd, upd, exchanges).step_s == pytest.approx(13.5)
    assert simulate(fwd, bwd, upd, exchanges, barrier=True).step_s == pytest.approx(15.0)


def test_busy_wire_share_counts_only_exchanges_beside_compute():
    # Layer 1's exchange runs beside layer 0's backward; layer 0's while the next forward waits for it.
    exchanges = [Transfer((1,), 1.0), Transfer((0,), 1.0)]
    assert simulate([1, 1], [1, 1], [0, 0], exchanges).busy_wire_share == pytest.approx(0.5)
    assert simulate([1, 1], [1, 1], [0, 0], exchanges, barrier=True).busy_wire_share == pytest.approx(0.5)
    # Communication-bound: after the first second beside layer 0's backward, the ranks only wait.
    assert simulate([1, 1], [1, 1], [0, 0], [Transfer((1,), 5), Transfer((0,), 5)]).busy_wire_share \
        == pytest.approx(1 / 10)


def test_network_cpu_steals_only_beside_compute():
    # Short of cores, the stack's CPU for the bytes comes out of the step in proportion to the busy share.
    from convoy.sim.strategies.base import Breakdown

    t = simulate([1, 1], [1, 1], [0, 0], [Transfer((1,), 1.0), Transfer((0,), 1.0)])
    cluster = Cluster(4, 1e9, cores=0.5)
    b = Breakdown.from_timeline("x", t, cluster, sent_bytes=1e9, ns_per_byte=1.0)
    assert b.step_s - t.step_s == pytest.approx(2 * 1e9 * 1e-9 * 0.5 / 0.5)


def test_a_remote_exchange_does_not_hold_back_this_ranks_updates():
    # The hybrid split's FC ring runs on the FC workers: layer 0's update must not wait behind it.
    # In the engine's order the aux thread would finish layer 1 (10 s) before layer 0: period 13.
    # Remote, only layer 1's own next forward waits for it: fwd 1 + bwd 1 + ring 10 = 12.
    own = [Transfer((1,), 10.0, channel=1), Transfer((0,), 1.0)]
    remote = [Transfer((1,), 10.0, channel=1, remote=True), Transfer((0,), 1.0)]
    assert simulate([1, 1], [1, 1], [0, 0], own).step_s == pytest.approx(13.0)
    assert simulate([1, 1], [1, 1], [0, 0], remote).step_s == pytest.approx(12.0)


def test_every_layer_needs_exactly_one_exchange():
    with pytest.raises(ValueError):
        simulate([1, 1], [1, 1], [0, 0], [Transfer((0,), 1)])


def test_threads_share_a_core_and_wait_for_each_other():
    finished: list[float] = []

    def compute(seconds: float):
        finished.append((yield ("cpu", seconds)))

    def after_first(seconds: float):
        yield ("until", lambda: finished[0] if finished else None)
        yield ("cpu", seconds)

    assert threads.run([compute(1.0), compute(1.0)], shared_rate=0.5) == pytest.approx(2.0)
    assert threads.run([compute(1.0), compute(1.0)]) == pytest.approx(1.0)
    finished.clear()
    # Alone the second runs at full speed: 1 + 2.
    assert threads.run([compute(1.0), after_first(2.0)], shared_rate=0.5) == pytest.approx(3.0)
    finished.clear()
    with pytest.raises(RuntimeError, match="deadlock"):
        threads.run([after_first(1.0)])
    with pytest.raises(ValueError, match="shared_rate"):
        threads.run([compute(1.0)], shared_rate=0.0)


def test_compression_beside_backward_slows_both_threads_on_a_shared_core():
    # Layer 1's codec (1 s) runs while layer 0's backward (1 s) does: at half speed
    # each, both end 2 s later and the period grows from 4 to 5.
    exchanges = [Transfer((1,), 0.0, codec_s=1.0), Transfer((0,), 0.0)]
    alone = simulate([1, 1], [1, 1], [0, 0], exchanges)
    shared = simulate([1, 1], [1, 1], [0, 0], exchanges, shared_rate=0.5)
    assert (alone.step_s, shared.step_s) == (pytest.approx(4.0), pytest.approx(5.0))
    assert shared.aux_shared and not alone.aux_shared
    assert Cluster(4, 1e9).shared_rate is None
    assert [Cluster(4, 1e9, cores=c).shared_rate for c in (0.5, 1.5, 4)] == [0.5, 0.75, 1.0]


def test_lanes_hide_latency_but_not_bytes():
    # Two 4 s exchanges that are all latency overlap on two lanes (period 11 -> 8);
    # all bytes, they still queue on the link.
    latency = [Transfer((1,), 4.0, bytes_s=0.0), Transfer((0,), 4.0, bytes_s=0.0)]
    loaded = [Transfer((1,), 4.0), Transfer((0,), 4.0)]
    assert simulate([1, 1], [1, 1], [0, 0], latency).step_s == pytest.approx(11.0)
    assert simulate([1, 1], [1, 1], [0, 0], latency, lanes=2).step_s == pytest.approx(8.0)
    assert simulate([1, 1], [1, 1], [0, 0], loaded, lanes=2).step_s == pytest.approx(11.0)
    with pytest.raises(ValueError, match="lanes"):
        simulate([1, 1], [1, 1], [0, 0], loaded, lanes=0)


def test_an_all_reduce_engine_gains_from_a_second_lane_only_on_latency(lenet):
    # lenet's small layers are all wake-ups at 4 ms a message: a second lane overlaps them.
    # With neither latency nor wake-ups every exchange is all bytes, which queue on the link.
    def step(**cluster) -> float:
        return LayerRing().step_time(lenet, Cluster(4, 1e9, **cluster)).step_s

    assert step(wake_s=4e-3, lanes=2) < step(wake_s=4e-3, lanes=1)
    assert step(lanes=2) == pytest.approx(step(lanes=1), rel=1e-9)


def test_the_auxiliary_thread_waits_for_an_agreement():
    # Global blocktopk: layer 1's score all-reduce (2 s) blocks the aux thread, so
    # layer 0's exchange (3 s) starts at 5, not when its gradient is ready at 4.
    agreed = [Transfer((1,), 0.0, agree=Transfer((1,), 2.0, bytes_s=0.0)), Transfer((0,), 3.0, bytes_s=0.0)]
    in_flight = [Transfer((1,), 2.0, bytes_s=0.0), Transfer((0,), 3.0, bytes_s=0.0)]
    assert simulate([1, 1], [1, 1], [0, 0], agreed, lanes=2).step_s == pytest.approx(8.0)
    assert simulate([1, 1], [1, 1], [0, 0], in_flight, lanes=2).step_s == pytest.approx(7.0)


# -------------------------------------------------------------- strategies
def test_sent_bytes_match_the_measured_lenet_traffic(lenet):
    # bench/results/compression_accuracy.json, lenet, 4 workers: kB sent per step.
    cluster = Cluster(4, 1e9)
    assert LayerRing().step_time(lenet, cluster).sent_bytes == sum(
        ring_allreduce_bytes(l.nbytes, 4) for l in lenet.layers) == 496956
    assert LayerRing(Compression("topk", 0.01)).step_time(lenet, cluster).sent_bytes == 20112
    # The seed's rows (block_size None); rle v2 records the block size: 6 more bytes for each of lenet's 10 parameters.
    rows = LayerRing(Compression("blocktopk", blocks_per_layer=1, block_size=None, dense_below=0))
    assert rows.step_time(lenet, cluster).sent_bytes == 12498
    # convoy train's default blocks of 16 elements: one block per parameter is far less than one row.
    blocks = Compression("blocktopk", blocks_per_layer=1, dense_below=0)
    assert LayerRing(blocks).step_time(lenet, cluster).sent_bytes < 12498 / 4
    assert LayerRing(Compression("fp16")).step_time(lenet, cluster).sent_bytes == 496956 // 2


def test_fast_links_approach_compute_and_slow_links_are_bandwidth_bound():
    p = toy()
    fast = LayerRing().step_time(p, Cluster(4, 1e12))
    assert fast.step_s == pytest.approx(p.compute_s - sum(l.update_s for l in p.layers), rel=0.02)
    slow = LayerRing().step_time(p, Cluster(4, 1e6))
    assert slow.step_s >= slow.wire_s > 100 * p.compute_s


def test_compression_helps_only_where_bandwidth_is_short():
    p = toy(params=4_000_000)
    slow, fast = Cluster(8, 100e6), Cluster(8, 1e12)
    dense, topk = LayerRing(), LayerRing(Compression("topk", 0.01))
    assert topk.step_time(p, slow).step_s < dense.step_time(p, slow).step_s / 5
    assert topk.step_time(p, fast).step_s > dense.step_time(p, fast).step_s   # selection costs CPU


def test_hierarchical_spreads_the_cycle_exchange_over_T_steps():
    p, cluster = toy(), Cluster(4, 1e9, racks=2, inter_rack_bps=1e8)
    every, rarely = ClusterCycles(2, 1).step_time(p, cluster), ClusterCycles(2, 20).step_time(p, cluster)
    cycle = every.notes["cycle_exchange_s"]
    assert every.step_s - rarely.step_s == pytest.approx(cycle * (1 - 1 / 20))
    assert rarely.step_s < LayerRing().step_time(p, cluster).step_s   # the slow link is used rarely


def test_ps_priority_lets_the_next_forward_start_early():
    ends, free = schedule([Message(0, 0.0, 2.0, (1,)), Message(1, 0.0, 1.0, (0,))], 0.0)
    assert ends == [3.0, 1.0] and free == 3.0
    p, cluster = toy(compute=0.05), Cluster(3, 1e8)
    graph = ServerShards(1, "graph", 64).step_time(p, cluster)
    fifo = ServerShards(1, "fifo", None).step_time(p, cluster)
    assert graph.step_s < fifo.step_s
    assert graph.notes["workers"] == 2


def test_hybrid_sends_activations_not_the_head():
    p, cluster = toy(params=4_000_000), Cluster(4, 100e6)
    hybrid = ConvFcSplit(3, 1).step_time(p, cluster)
    dense = LayerRing().step_time(p, cluster)
    assert hybrid.sent_bytes < dense.sent_bytes / 5   # the conv layers are a sixth of the model
    with pytest.raises(UsageError):
        ConvFcSplit(2, 1).step_time(p, cluster)   # 3 nodes, not 4


def test_ddp_buckets_and_powersgd_factor_sizes():
    from convoy.sim.strategies.ddp import ddp_buckets, powersgd_floats

    assert powersgd_floats((1024, 2048), 1) == (0, 1024 + 2048)
    assert powersgd_floats((10,), 1) == (10, 0)
    assert powersgd_floats((4, 4), 4) == (16, 0)   # factors no smaller than the matrix
    p = toy()
    assert sorted(i for b in ddp_buckets(p.layers) for i in b) == [0, 1, 2]
    assert TorchDDP(1).step_time(p, Cluster(4, 1e8)).sent_bytes < TorchDDP().step_time(p, Cluster(4, 1e8)).sent_bytes / 10


def test_shared_cores_slow_compute_and_charge_side_work():
    p = toy()
    alone, shared = LayerRing().step_time(p, Cluster(4, 1e9)), LayerRing().step_time(p, Cluster(4, 1e9, cores=0.5))
    assert shared.compute_s == pytest.approx(2 * alone.compute_s)
    assert shared.notes["cpu_stolen_s"] > 0 and "cpu_stolen_s" not in alone.notes


# ---------------------------------------------------------------- profiles
def test_profile_of_lenet_follows_forward_order(lenet, tmp_path):
    assert [l.name for l in lenet.layers] == ["features.0", "features.3", "classifier.1", "classifier.3",
                                              "classifier.5"]
    assert [l.head for l in lenet.layers] == [False, False, True, True, True]
    assert lenet.params == 82826 and lenet.activation_bytes == 16 * 6 * 6 * 4
    assert all(l.forward_s > 0 and l.backward_s >= 0 for l in lenet.layers)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(lenet.to_json()))
    assert load_profile(path) == lenet
    assert lenet.at_batch(16).layers[0].forward_s == pytest.approx(2 * lenet.layers[0].forward_s)


def test_bad_profile_and_cluster_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"layers": [{"name": "x"}]}')
    with pytest.raises(UsageError):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "0mbit"\n')
    with pytest.raises(UsageError):
        load_cluster(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text('nodes = 4\nrate = "1gbit"\nbandwidth = 3\n')
    with pytest.raises(UsageError, match="unknown cluster keys"):
        load_cluster(tmp_path / "d.toml")


def test_cluster_files_in_both_formats(tmp_path):
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "100mbit"\nracks = 2\ninter_rack_rate = "10mbit"\n'
                                     'latency_ms = 0.5\nwake_ms = 3\ncores = 0.5\nlanes = 1\n')
    c = load_cluster(tmp_path / "c.toml")
    assert (c.nodes, c.rate_bps, c.racks, c.inter_rack_bps, c.latency_s, c.cores, c.lanes) \
        == (4, 1e8, 2, 1e7, 5e-4, 0.5, 1)
    assert c.ring_link().wake_s == c.host_link().wake_s == 3e-3
    nodes = [{"rank": r, "host": f"h{r}", "cpu_mhz": 2000 if r < 3 else 1000, "memory_gb": 8, "gpu_mhz": 0,
              "gpu_memory_gb": 0, "disk_mbps": 500, "uplink_mbps": 1000 if r else 100} for r in range(4)]
    (tmp_path / "n.json").write_text(json.dumps({"nodes": nodes, "clusters": [[0, 1], [2, 3]], "servers": [0, 2],
                                                 "latency_ms": 0.5, "wake_ms": 3}))
    n = load_cluster(tmp_path / "n.json")
    assert (n.nodes, n.rate_bps, n.racks, n.latency_s, n.wake_s, n.lanes) == (4, 1e8, 2, 5e-4, 3e-3, 2)
    assert n.speeds == (1.0, 1.0, 1.0, 0.5) and n.slowdown == 2.0
    assert n.rates == (1e8, 1e9, 1e9, 1e9)   # each node's own uplink, for emulated clusters


def test_cluster_files_give_each_node_its_link_rate_or_one_for_all(tmp_path):
    (tmp_path / "r.toml").write_text('nodes = 3\nrates = ["1gbit", "250mbit", 1e9]\n')
    r = load_cluster(tmp_path / "r.toml")
    assert r.rates == (1e9, 250e6, 1e9) and r.rate_bps == 250e6   # the simulator models the slowest
    for body in ('nodes = 3\n', 'nodes = 3\nrate = "1gbit"\nrates = ["1gbit", "1gbit", "1gbit"]\n'):
        (tmp_path / "b.toml").write_text(body)
        with pytest.raises(UsageError, match="rate .* or rates"):
            load_cluster(tmp_path / "b.toml")
    (tmp_path / "n.toml").write_text('nodes = 3\nrates = ["1gbit", "1gbit"]\n')
    with pytest.raises(UsageError, match="rates needs 3"):
        load_cluster(tmp_path / "n.toml")


# --------------------------------------------------------------------- CLI
def _write_toy(tmp_path) -> str:
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(toy().to_json()))
    return str(path)


def test_simulate_cli_table_and_json(tmp_path, capsys):
    profile = _write_toy(tmp_path)
    assert main(["simulate", "--profile", profile, "--batch-size", "16", "--nodes", "4", "--rate", "100mbit"]) == 0
    out = capsys.readouterr().out
    rank = DEFAULT_POWERSGD_RANK   # convoy simulate's default is convoy train's
    assert "allreduce topk 0.01" in out and "hybrid 3+1" in out
    assert f"ddp powersgd {rank}" in out and f"allreduce powersgd {rank}" in out
    assert main(["simulate", "--profile", profile, "--batch-size", "16", "--strategy", "allreduce", "ps",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["strategy"] for r in rows] == ["allreduce", "ps S=1 graph slice 256kB"]


@pytest.mark.parametrize("argv, message", [
    (["--rate", "0mbit"], "link rate"),
    (["--rate=-5gbit"], "link rate"),
    (["--strategy", "gossip"], "unknown strategy 'gossip'"),
    (["--cluster", "/nonexistent/cluster.toml"], "does not exist"),
    (["--profile", "/nonexistent/p.json"], "does not exist"),
    (["--nodes", "0"], "at least one node"),
    (["--lanes", "0"], "lanes must be >= 1"),
])
def test_simulate_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convoy: error: ") and message in err and err.count("\n") == 1


def test_convoy_powersgd_sends_what_the_runtime_sends_and_models_its_two_rounds():
    # tests/test_powersgd.py counts the runtime: 2 ranks, a (24, 3, 2, 2) conv and its bias,
    # rank 2: P (24 x 2) then Q (12 x 2) and the bias (24), 384 bytes a step.
    layer = ModelProfile("conv", (LayerProfile("c", ((24, 3, 2, 2), (24,)), 1e-3, 2e-3),), batch_size=8,
                         activation_bytes=0)
    powersgd = LayerRing(Compression("powersgd", rank=2))
    assert powersgd.step_time(layer, Cluster(2, 1e9)).sent_bytes == 384
    assert Compression("powersgd", rank=2).agreement(((24, 3, 2, 2), (24,))) == 24 * 2 * 4   # P, waited for
    assert Compression("powersgd", rank=12).payload(((24, 3, 2, 2), (24,))) == ("allreduce", 4 * 312)  # dense
    # On an FC-heavy model at 100 Mbit it sends far less than dense, and steps faster.
    p = toy()
    dense, low = LayerRing().step_time(p, Cluster(4, 1e8)), powersgd.step_time(p, Cluster(4, 1e8))
    assert low.sent_bytes * 50 < dense.sent_bytes and low.step_s < dense.step_s


def test_blocktopk_models_the_block_size_and_the_warmup_ramp():
    shapes = ((1000, 100), (1000,))
    small, large = Compression("blocktopk", block_fraction=0.01), Compression("blocktopk", block_fraction=0.01,
                                                                                block_size=1000)
    assert small.flags() == ["--compress", "blocktopk", "--block-fraction", "0.01"]          # 16 is the default
    assert large.flags()[-2:] == ["--block-size", "1000"] and large.label() == "blocktopk 0.01 block 1000"
    assert small.payload(shapes)[1] < large.payload(shapes)[1] * 2
    ramp = small.ramp_mean()
    # 25% decaying exponentially to 1%: the mean density is (0.25 - 0.01) / ln 25.
    assert ramp.block_fraction == pytest.approx(0.24 / math.log(25))
    assert Compression("fp16").ramp_mean() == Compression("fp16")
