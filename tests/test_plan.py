"""convoy plan: ranking on a hand-built profile, only real flags, and the command line."""
from __future__ import annotations

import json
import shlex

import pytest

from convoy.cli.main import build_parser, main
from convoy.cli.plan import available, rank, train_choices, train_flags
from convoy.cli.train import config_from_args
from convoy.sim.catalog import candidates
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
    assert len(out) == 2 + 3 and "convoy train --nproc 4 --model vgg_fc --batch-size 16" in out[2]
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
