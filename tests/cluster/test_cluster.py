"""Profiling, normalisation, clustering, election and contribution weights."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from convoy.cli.main import main
from convoy.cluster import (DEFAULT_WEIGHTS, INDICATORS, ContributionHistory, Election, IndicatorHistory, NodeProfile,
                            cluster_vectors, load_profile_file, make_plan, parse_weights)
from convoy.cluster.profile import MACHINE_INDICATORS, disk_mbps, one_profile_per_machine, profile_job
from convoy.errors import UsageError
from tests.helpers import indicator_table, run_workers

FULL = "\n".join(f"{name} = 1" for name in INDICATORS)


def test_normalisation_uses_the_historical_max_average_and_min_on_a_log_scale():
    history = IndicatorHistory()
    # log2(1 + x) of 1, 3, 15: 1, 2, 4 (avg 7/3, spread 3); memory never varies and contributes 0.
    history.record([{"cpu_mhz": 1.0, "memory_gb": 8.0}, {"cpu_mhz": 3.0, "memory_gb": 8.0},
                    {"cpu_mhz": 15.0, "memory_gb": 8.0}])
    normalised = history.normalise({"cpu_mhz": 1.0, "memory_gb": 8.0})
    assert normalised["cpu_mhz"] == pytest.approx(-4 / 9) and normalised["memory_gb"] == 0.0
    history.record([{"cpu_mhz": 63.0, "memory_gb": 8.0}])   # a later round widens the history: 1, 2, 4, 6
    assert history.normalise({"cpu_mhz": 15.0})["cpu_mhz"] == pytest.approx((4 - 13 / 4) / 5)
    # A noisy fast link stays far from a slow one: 400 and 900 Mbit/s against 48.
    links = IndicatorHistory()
    links.record([{"uplink_mbps": v} for v in (900.0, 400.0, 48.0, 48.0)])
    (fast, middle, slow) = (links.normalise({"uplink_mbps": v})["uplink_mbps"] for v in (900.0, 400.0, 48.0))
    assert fast - middle < middle - slow


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=6).flatmap(
    lambda sizes: st.tuples(st.just(sizes), st.lists(st.lists(st.floats(-1, 1), min_size=len(sizes),
                                                               max_size=len(sizes)), max_size=5))))
def test_contribution_weights_are_non_negative_and_sum_to_one(case):
    sizes, cycles = case
    history = ContributionHistory(sizes)
    for agreements in cycles:
        history.record(agreements)
        weights = history.weights()
        assert min(weights) >= 0 and sum(weights) == pytest.approx(1.0, abs=1e-12)


def test_contribution_weights_are_the_size_shares_when_clusters_agree_and_drop_a_dissenter():
    history = ContributionHistory([1, 3, 4])
    assert history.weights() == [0.125, 0.375, 0.5]
    for _ in range(3):
        history.record([1.0, 1.0, 1.0])
    assert history.weights() == [0.125, 0.375, 0.5]
    history.record([-1.0, 1.0, 1.0])   # mean agreement of cluster 0: (3 - 1) / 4 = 0.5
    assert history.weights() == pytest.approx([0.5 / 7.5, 3 / 7.5, 4 / 7.5])
    for _ in range(4):
        history.record([-1.0, 1.0, 1.0])
    assert history.weights()[0] == 0.0
    opposed = ContributionHistory([2, 2])
    opposed.record([-1.0, -1.0])
    assert opposed.weights() == [0.5, 0.5]   # no score left: back to the size shares


def test_kmeans_finds_obvious_groups_in_canonical_order_and_auto_picks_their_number():
    vectors = np.array([[5.0, 0.1], [0.0, 0.0], [5.1, 0.0], [0.1, 0.1], [0.0, 0.1]])
    assert cluster_vectors(vectors, 2, seed=0) == [[0, 2], [1, 3, 4]]
    assert cluster_vectors(vectors, "auto", seed=7) == [[0, 2], [1, 3, 4]]
    assert cluster_vectors(np.zeros((4, 3)), "auto") == [[0, 1, 2, 3]]
    assert cluster_vectors(np.zeros((4, 3)), 2) == [[0, 1], [2, 3]]   # alike nodes: split by rank
    with pytest.raises(UsageError, match="more than the 5 nodes"):
        cluster_vectors(vectors, 6)


def test_election_is_reproducible_rotates_every_r_cycles_and_can_pick_the_most_capable():
    clusters = [[0, 3, 5], [1, 2], [4]]
    first = Election(clusters, every=2, seed=11)
    again = Election(clusters, every=2, seed=11)
    servers = [first.servers(c) for c in range(12)]
    assert servers == [again.servers(c) for c in range(12)]
    for c in range(12):
        assert servers[c] == servers[c - c % 2]          # one election lasts R = 2 cycles
        for k, members in enumerate(clusters):
            assert servers[c][k] in members
    # Within a cluster every member serves once before any serves twice.
    assert sorted(servers[c][0] for c in (0, 2, 4)) == [0, 3, 5]
    assert servers[0][1] != servers[2][1]
    capable = Election(clusters, every=1, choice="capable", capability=(0.1, 0.5, 0.5, 0.9, 0.0, 0.2))
    assert capable.servers(0) == capable.servers(5) == [3, 1, 4]


def test_indicator_weights_parse_and_reject_negative_or_all_zero():
    assert parse_weights(None) == DEFAULT_WEIGHTS
    assert parse_weights("uplink_mbps=4, disk_mbps=0")["uplink_mbps"] == 4.0
    assert list(parse_weights("1,2,3,4,5,6").values()) == [1, 2, 3, 4, 5, 6]
    for bad, message in (("cpu_mhz=-1", "must be >= 0"), ("0,0,0,0,0,0", "all zero"), ("gpu=1", "unknown indicator"),
                         ("1,2", "needs 6 numbers")):
        with pytest.raises(UsageError, match=message):
            parse_weights(bad)


def test_profile_file_layers_all_host_and_rank_tables_and_names_what_is_missing(tmp_path):
    path = tmp_path / "nodes.toml"
    path.write_text(f"[all]\n{indicator_table(disk_mbps='measure')}\n[hosts.b]\nuplink_mbps = 50\n"
                    "[ranks.3]\nuplink_mbps = 10\n")
    overrides = load_profile_file(str(path))
    assert overrides.for_rank(0, "a")["uplink_mbps"] == 1.0 and "disk_mbps" not in overrides.for_rank(0, "a")
    assert overrides.for_rank(2, "b")["uplink_mbps"] == 50.0 and overrides.for_rank(3, "b")["uplink_mbps"] == 10.0
    path.write_text(f"[ranks.0]\n{FULL}\n[ranks.1]\ncpu_mhz = 1\n")
    overrides = load_profile_file(str(path))
    with pytest.raises(UsageError, match="rank 1 lacks memory_gb"):
        overrides.check_world(2)
    with pytest.raises(UsageError, match="no table for rank 2"):
        overrides.for_rank(2, "c")
    for text, message in (("[all]\nflops = 3\n", "unknown indicator 'flops'"), ("[all]\ncpu_mhz = -3\n", ">= 0"),
                          ("[nodes.a]\ncpu_mhz = 3\n", "unknown table")):
        path.write_text(text)
        with pytest.raises(UsageError, match=message):
            load_profile_file(str(path))


def test_a_world_of_one_measures_itself_and_the_file_replaces_measurements(tmp_path):
    assert disk_mbps(str(tmp_path), nbytes=1 << 20) > 0
    path = tmp_path / "nodes.toml"
    path.write_text(f"[all]\n{indicator_table(cpu_mhz=1234, disk_mbps='measure')}\n")
    (profile,) = profile_job(load_profile_file(str(path)))
    assert profile.cpu_mhz == 1234 and profile.disk_mbps > 0 and "disk_mbps" not in profile.from_file
    plan = make_plan([profile, NodeProfile(1, "x", 1.0, 1.0, 0.0, 0.0, 1.0, 1.0)], DEFAULT_WEIGHTS, "auto")
    assert plan.clusters == [[0, 1]] and plan.as_json()["servers"] in ([0], [1])


@pytest.mark.parametrize("args,expected", [
    (["train", "--sync", "hierarchical", "--nproc", "4", "--clusters", "5"], "--clusters 5 is more than the 4 nodes"),
    (["profile-nodes", "--nproc", "2", "--clusters", "3"], "--clusters 3 is more than the 2 nodes"),
    (["train", "--sync", "hierarchical", "--indicator-weights", "uplink_mbps=-2"], "must be >= 0"),
    (["train", "--sync", "hierarchical", "--indicator-weights", "0,0,0,0,0,0"], "all zero"),
    (["train", "--sync", "hierarchical", "--exchange-every", "0"], "--exchange-every must be >= 1"),
    (["train", "--sync", "hierarchical", "--reelect-every", "0"], "--reelect-every must be >= 1"),
    (["train", "--sync", "hierarchical", "--clusters", "two"], "--clusters must be a number or auto"),
    (["train", "--clusters", "2"], "need --sync hierarchical"),
    (["train", "--sync", "hierarchical", "--nproc", "3", "--node-profile", "{missing_rank}"], "no table for rank 2"),
    (["train", "--sync", "hierarchical", "--node-profile", "{missing_indicator}"], "rank 1 lacks uplink_mbps"),
    (["profile-nodes", "--nproc", "3", "--node-profile", "{missing_rank}"], "no table for rank 2"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected, tmp_path, capsys):
    (tmp_path / "rank.toml").write_text(f"[ranks.0]\n{FULL}\n[ranks.1]\n{FULL}\n")
    (tmp_path / "indicator.toml").write_text(f"[ranks.0]\n{FULL}\n[ranks.1]\ncpu_mhz = 1\nmemory_gb = 1\n"
                                             "gpu_mhz = 0\ngpu_memory_gb = 0\ndisk_mbps = 1\n")
    args = [a.format(missing_rank=tmp_path / "rank.toml", missing_indicator=tmp_path / "indicator.toml")
            for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convoy: error: ") and expected in err[0], err


def test_a_plan_moves_to_global_ranks_and_round_trips_through_tensors():
    from convoy.cluster.plan import clusters_from_tensors

    profiles = [NodeProfile(r, "h", 3000.0, 16.0, 0.0, 0.0, 400.0, 50.0 if r == 1 else 1000.0) for r in range(3)]
    plan = make_plan(profiles, dict(DEFAULT_WEIGHTS), 2, seed=0, reelect_every=1, server_choice="capable")
    moved = plan.on_ranks([4, 5, 6])   # a hybrid job's FC group
    assert moved.clusters == [[4 + r for r in members] for members in plan.clusters]
    for cycle in range(3):   # the same election, on the group's global ranks
        assert moved.servers(cycle) == [4 + s for s in plan.servers(cycle)]
    clusters, capability = clusters_from_tensors(moved.as_tensors())
    assert clusters == moved.clusters
    restored = plan.with_clusters(clusters, capability)
    assert restored.clusters == moved.clusters and restored.servers(0) == moved.servers(0)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.floats(1000.0, 30000.0), min_size=4, max_size=4), st.lists(st.floats(100.0, 600.0), min_size=4,
       max_size=4), st.sampled_from([2, "auto"]))
def test_nodes_alike_within_the_noise_get_the_same_plan_in_every_run(uplinks, disks, clusters):
    """One machine's ranks measured twice differ by noise alone (uplink tries 99% apart, disk 80%):
    a split along that noise would differ from run to run, and with it the training. Within the
    noise the nodes are planned as alike: consecutive ranks, whatever the draw."""
    profiles = [NodeProfile(r, "h", 2596.0, 23.5, 0.0, 0.0, disk, uplink,
                            noise={"uplink_mbps": 0.99, "disk_mbps": 0.8})
                for r, (uplink, disk) in enumerate(zip(uplinks, disks))]
    plan = make_plan(profiles, DEFAULT_WEIGHTS, clusters=clusters)
    assert plan.clusters == ([[0, 1], [2, 3]] if clusters == 2 else [[0, 1, 2, 3]])
    if clusters == 2:
        assert "planned as alike nodes" in plan.noise_warning()
    # Beyond the noise the measurements decide: a 20x slower uplink on ranks 1 and 3.
    apart = [NodeProfile(r, "h", 2596.0, 23.5, 0.0, 0.0, 500.0, 50.0 if r % 2 else 1000.0,
                         noise={"uplink_mbps": 0.3}) for r in range(4)]
    assert make_plan(apart, DEFAULT_WEIGHTS, clusters=clusters).clusters == [[0, 2], [1, 3]]


def _local_profiles(rank: int, world: int) -> list[dict]:
    return [p.as_dict() for p in profile_job()]


@pytest.mark.timeout(120)
def test_ranks_on_one_machine_share_its_measured_indicators_so_a_local_job_is_planned_alike():
    # Measured per process, four local ranks' uplinks differed by the machine's load of the moment,
    # enough (at a load of 15 on 2 cores) to split one local job's ranks otherwise than the next run's.
    first, *others = run_workers(_local_profiles, 4)
    assert all(other == first for other in others)
    machine = [{name: p[name] for name in MACHINE_INDICATORS} for p in first]
    assert all(m == machine[0] for m in machine) and machine[0]["uplink_mbps"] > 0
    plan = make_plan([NodeProfile(**{k: v for k, v in p.items()}) for p in first], DEFAULT_WEIGHTS, 2)
    assert plan.clusters == [[0, 1], [2, 3]]


def test_a_machines_lowest_rank_speaks_for_it_but_a_profile_file_sets_ranks_apart():
    profiles = [NodeProfile(0, "h", cpu_mhz=2000.0, uplink_mbps=900.0),
                NodeProfile(1, "h", cpu_mhz=1900.0, uplink_mbps=48.0, from_file=("uplink_mbps",)),
                NodeProfile(2, "g", cpu_mhz=1000.0, uplink_mbps=100.0, noise={"uplink_mbps": 0.1}),
                NodeProfile(3, "g", cpu_mhz=1100.0, uplink_mbps=120.0)]
    profiles = one_profile_per_machine(profiles, ["h/1", "h/1", "g/1", "g/1"])
    assert [p.cpu_mhz for p in profiles] == [2000.0, 2000.0, 1000.0, 1000.0]
    assert [p.uplink_mbps for p in profiles] == [900.0, 48.0, 100.0, 100.0]
    assert profiles[3].noise == {"uplink_mbps": 0.1}
