"""convoy plan: ranking on a hand-built profile, only real flags, and the command line."""
from __future__ import annotations

import json
import shlex

import pytest

from convoy.cli.main import build_parser, main
from convoy.cli.plan import available, rank, train_choices, train_flags
from convoy.cli.train import config_from_args
from convoy.compress import DEFAULT_POWERSGD_RANK
from convoy.sim.catalog import PEER_POWERSGD_RANKS, candidates
from convoy.sim.cluster import Cluster
from convoy.sim.profile import LayerProfile, ModelProfile


def fc_heavy() -> ModelProfile:
    """vgg_fc-like: cheap conv layers, a 3 M-parameter head, 0.1 s of compute per step."""
    layers = (LayerProfile("features.0", ((32, 1, 3, 3), (32,)), 0.01, 0.02, 1e-4),
              LayerProfile("features.2", ((64, 32, 3, 3), (64,)), 0.01, 0.02, 1e-4),
              LayerProfile("classifier.1", ((1024, 2048), (1024,)), 0.005, 0.01, 2e-3, head=True),
              LayerProfile("classifier.3", ((1024, 1024), (1024,)), 0.003, 0.005, 1e-3, head=True),
              LayerProfile("classifier.5", ((10, 1024), (10,)), 0.001, 0.001, 1e-5, head=True))
    return ModelProfile("vgg_fc", layers, batch_size=16, activation_bytes=8192)


def ranked(rate: float, known=None, nodes: int = 4) -> list[dict]:
    cluster = Cluster(nodes, rate)
    return rank(fc_heavy(), cluster, candidates(nodes, has_head=True), known or train_flags(), train_choices())


def test_available_checks_flags_and_their_choices():
    known, choices = {"--compress", "--sync"}, {"--sync": ("allreduce",), "--compress": ("topk",)}
    assert available(["--compress", "topk"], known, choices)
    assert not available(["--compress", "powersgd"], known, choices)
    assert not available(["--sync", "ps", "--servers", "1"], known, choices)
    assert not available(["--element-fraction", "0.1"], known, choices)


def test_slow_links_rank_a_low_traffic_strategy_first_and_dense_lower():
    rows = ranked(100e6)
    top = rows[0]
    assert top["available"] and top["sent_MB"] < 1.0
    dense = next(r for r in rows if r["strategy"] == "allreduce")
    assert dense["rank"] > 5 and top["samples_per_s"] > 3 * dense["samples_per_s"]
    speeds = [r["samples_per_s"] for r in rows if r["available"]]
    assert speeds == sorted(speeds, reverse=True)


def test_fast_links_do_not_pay_for_compression():
    rows = ranked(1e12)
    by_name = {r["strategy"]: r for r in rows}
    assert by_name["allreduce"]["samples_per_s"] > by_name["allreduce topk 0.01"]["samples_per_s"]
    assert rows[0]["samples_per_s"] == pytest.approx(by_name["allreduce"]["samples_per_s"], rel=0.05)


def test_unknown_flags_are_never_ranked_first():
    known = train_flags() - {"--compress", "--parallel"}   # a convoy without compression or hybrid
    rows = ranked(100e6, known)
    first_unavailable = next(i for i, r in enumerate(rows) if not r["available"])
    assert all(not r["available"] for r in rows[first_unavailable:])
    assert rows[0]["strategy"].split()[0] in ("allreduce", "hierarchical", "ps")
    assert "--compress" not in rows[0]["command"]


def test_every_available_command_parses_as_convoy_train():
    parser = build_parser()
    for row in ranked(1e9):
        if row["available"]:
            argv = shlex.split(row["command"])
            assert argv[:2] == ["convoy", "train"]
            config_from_args(parser.parse_args(argv[1:])).validate()


def test_plan_cli(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(fc_heavy().to_json()))
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "100mbit"\n')
    assert main(["plan", str(tmp_path / "c.toml"), "--profile", str(tmp_path / "p.json"), "--batch-size", "16",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "convoy train --nproc 4 --model vgg_fc --batch-size 16" in out[2] and out[2 + 3] == ""
    # Then who wins against the peers, then one torchrun line per machine, node i's rank i,
    # each with the first row's training flags.
    assert out[2 + 3 + 1].startswith(("Convoy wins: ", "A peer would win: ")) and out[2 + 3 + 2] == ""
    nodes = [shlex.split(line) for line in out[2 + 3 + 4:]]
    first_row = shlex.split(out[2][out[2].index("convoy train"):])
    assert len(nodes) == 4
    for node, argv in enumerate(nodes):
        assert argv[:10] == ["torchrun", "--nnodes", "4", "--node-rank", str(node), "--nproc-per-node", "1",
                             "--master-addr", "HOST0", "--master-port"]
        assert argv[argv.index("-m"):] == ["-m", "convoy", "train", *first_row[4:]]
    assert main(["plan", str(tmp_path / "c.toml"), "--profile", str(tmp_path / "p.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["rank"] == 1 and len(rows) > 20


def test_plan_cli_bad_input(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = 0\n')
    assert main(["plan", str(tmp_path / "c.toml"), "--model", "lenet"]) == 2
    assert main(["plan", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("convoy: error: ") for line in err)


def test_flags_and_from_flags_are_inverse():
    from convoy.sim.catalog import from_flags

    for strategy in candidates(8, racks=2, has_head=True):
        assert from_flags(strategy.flags(), 8).label == strategy.label


def steps_file(tmp_path, runs: list[dict], **top) -> str:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({**top, "runs": runs}))
    return str(path)


def test_steps_to_target_rank_by_time_to_accuracy_not_by_step(tmp_path):
    from convoy.sim.convergence import load_convergence

    # topk 1% has the faster step at 100 Mbit, but needing 20x the steps it must lose to dense.
    path = steps_file(tmp_path, [{"flags": "", "steps_to_target": 100},
                                 {"flags": "--compress topk --element-fraction 0.01", "steps_to_target": 2000},
                                 {"flags": ["--compress", "fp16"], "steps_to_target": None}])
    convergence = load_convergence(path, 4)
    rows = rank(fc_heavy(), Cluster(4, 100e6), candidates(4, has_head=True), train_flags(), train_choices(),
                convergence)
    by_name = {r["strategy"]: r for r in rows}
    assert by_name["allreduce topk 0.01"]["step_s"] < by_name["allreduce"]["step_s"]
    assert [r["strategy"] for r in rows[:2]] == ["allreduce", "allreduce topk 0.01"]
    assert by_name["allreduce"]["time_to_target_s"] == pytest.approx(100 * by_name["allreduce"]["step_s"])
    # Then the unmeasured ones by samples/s, and last (of the available) the one that never got there.
    available = [r for r in rows if r["available"]]
    assert available[-1]["strategy"] == "allreduce fp16" and available[-1]["steps_to_target"] is None
    middle = [r["samples_per_s"] for r in available[2:-1]]
    assert middle == sorted(middle, reverse=True) and not any(r["measured"] for r in available[2:-1])


def test_warmup_steps_are_priced_at_the_ramps_mean_density_and_kept_in_the_command(tmp_path):
    from convoy.sim.codec import Compression
    from convoy.sim.convergence import load_convergence
    from convoy.sim.strategies import LayerRing

    path = steps_file(tmp_path, [{"flags": "--compress topk", "steps_to_target": 50},
                                 {"flags": "", "steps_to_target": 30}], warmup_steps=20)
    convergence = load_convergence(path, 4)
    cluster, profile = Cluster(4, 100e6), fc_heavy()
    dense_s = LayerRing().step_time(profile, cluster).step_s
    topk = LayerRing(Compression("topk", 0.01))
    topk_s = topk.step_time(profile, cluster).step_s
    assert convergence.time_to_target(topk, topk_s, dense_s) == pytest.approx(20 * dense_s + 30 * topk_s)
    assert convergence.time_to_target(LayerRing(), dense_s, dense_s) == pytest.approx(30 * dense_s)
    rows = {r["strategy"]: r for r in rank(profile, cluster, [topk, LayerRing()], train_flags(), train_choices(),
                                           convergence)}
    # plan prices a warm-up step of the density ramp (25% down to 1%) at the ramp's mean density.
    ramp_s = LayerRing(Compression("topk", 0.01).ramp_mean()).step_time(profile, cluster).step_s
    assert topk_s < ramp_s < dense_s
    assert rows["allreduce topk 0.01"]["time_to_target_s"] == pytest.approx(20 * ramp_s + 30 * topk_s)
    assert rows["allreduce topk 0.01"]["command"].endswith("--warmup-steps 20")
    assert "--warmup-steps" not in rows["allreduce"]["command"]
    config_from_args(build_parser().parse_args(shlex.split(rows["allreduce topk 0.01"]["command"])[1:])).validate()


def test_plan_cli_with_steps_to_target(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(fc_heavy().to_json()))
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "1gbit"\n')
    path = steps_file(tmp_path, [{"flags": "--parallel hybrid --conv-workers 2 --fc-workers 2", "steps_to_target": 80},
                                 {"flags": "", "steps_to_target": 60}], model="vgg_fc", batch_size=16, nodes=4)
    argv = ["plan", str(tmp_path / "c.toml"), "--profile", str(tmp_path / "p.json"), "--batch-size", "16"]
    assert main(argv + ["--steps-to-target", path, "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "shortest predicted time to target first" in out[0] and "time to target s" in out[1]
    assert out[2 + 3] == "" and "-" in out[4].split()   # then the per-node torchrun lines
    assert main(argv + ["--steps-to-target", path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {rows[0]["strategy"], rows[1]["strategy"]} == {"allreduce", "hybrid 2+2"}
    assert rows[0]["time_to_target_s"] <= rows[1]["time_to_target_s"] and rows[2]["time_to_target_s"] is None


@pytest.mark.parametrize("top, runs, message", [
    ({"model": "resnet18"}, [{"flags": "", "steps_to_target": 5}], "measured with model resnet18"),
    ({"nodes": 8}, [{"flags": "", "steps_to_target": 5}], "measured with number of nodes 8"),
    ({}, [{"flags": "", "steps_to_target": 0}], "positive integer or null"),
    ({}, [{"flags": "", "steps_to_target": "5"}], "positive integer or null"),
    ({}, [{"steps_to_target": 5}], "needs \"flags\""),
    ({}, [], "non-empty list"),
    ({}, [{"flags": "--compress zip", "steps_to_target": 5}], "unknown strategy"),
    ({"warmup_steps": -1}, [{"flags": "", "steps_to_target": 5}], "warmup_steps"),
    ({"batch_size": "x"}, [{"flags": "", "steps_to_target": 5}], "bad steps-to-target file"),
])
def test_plan_cli_bad_steps_file(tmp_path, capsys, top, runs, message):
    (tmp_path / "p.json").write_text(json.dumps(fc_heavy().to_json()))
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "1gbit"\n')
    path = steps_file(tmp_path, runs, **top)
    assert main(["plan", str(tmp_path / "c.toml"), "--profile", str(tmp_path / "p.json"), "--batch-size", "16",
                 "--steps-to-target", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("convoy: error: ") and message in err[0]


def test_plan_cli_missing_steps_file(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('nodes = 4\nrate = "1gbit"\n')
    assert main(["plan", str(tmp_path / "c.toml"), "--model", "lenet", "--steps-to-target",
                 str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_peers_are_ranked_beside_convoy_and_plan_says_who_wins(capsys):
    from convoy.cli.plan import verdict
    from convoy.sim.catalog import peers

    rows = rank(fc_heavy(), Cluster(4, 100e6), candidates(4, has_head=True) + peers(), train_flags(),
                train_choices())
    by_name = {r["strategy"]: r for r in rows}
    peer = by_name["ddp powersgd 2"]
    assert peer["peer"] and peer["available"] and not peer["node_commands"]
    assert peer["command"].startswith("torchrun --nproc-per-node 4 bench/peers/ddp_train.py")
    assert "--compress powersgd" in by_name[f"allreduce powersgd {DEFAULT_POWERSGD_RANK}"]["command"]
    assert {f"ddp powersgd {rank}" for rank in PEER_POWERSGD_RANKS} <= set(by_name)   # the rank sweep a user runs
    line = verdict(rows)
    best_ours = next(r for r in rows if not r["peer"])
    best_peer = next(r for r in rows if r["peer"])
    ratio = best_ours["samples_per_s"] / best_peer["samples_per_s"]
    if ratio >= 1:
        assert line.startswith(f"convoy wins: {best_ours['strategy']} is predicted {ratio:.2f}x faster")
    else:
        assert line.startswith(f"a peer would win: {best_peer['strategy']}")
    # A peer measured to reach the target far sooner wins, and plan says so.
    fast = [{**best_peer, "time_to_target_s": 10.0}, {**best_ours, "time_to_target_s": 25.0}]
    assert verdict(fast).startswith(f"a peer would win: {best_peer['strategy']} is predicted 2.50x faster to the "
                                    f"target than convoy's best ({best_ours['strategy']})")
