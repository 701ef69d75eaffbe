"""``convoy profile-nodes`` and ``convoy train --sync hierarchical`` as a user runs them."""
from __future__ import annotations

import json

import pytest

from convoy.cluster import INDICATORS
from tests.helpers import convoy_in_process, profile_toml

LENET_PARAMETERS = 82_826   # on digits (1 channel, 10 classes)
PROFILE = profile_toml(slow=(1,), disk="measure")


@pytest.mark.timeout(300)
def test_profile_nodes_json_and_a_hierarchical_compressed_run(tmp_path):
    profile = tmp_path / "nodes.toml"
    profile.write_text(PROFILE)
    result = convoy_in_process("profile-nodes", "--nproc", "2", "--node-profile", str(profile), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["clusters"] == [[0, 1]] and report["servers"] in ([0], [1])   # auto: two nodes, one cluster
    assert [node["uplink_mbps"] for node in report["nodes"]] == [1000, 50]
    assert set(report["weights"]) == set(INDICATORS)
    for node in report["nodes"]:
        assert {"rank", "host", *INDICATORS, "normalised"} <= set(node) and len(node["normalised"]) == 6
        assert node["disk_mbps"] > 0   # "measure": measured for real

    out = tmp_path / "run"
    result = convoy_in_process("train", "--sync", "hierarchical", "--nproc", "2", "--clusters", "2",
                               "--exchange-every", "2", "--node-profile", str(profile), "--compress", "fp16",
                               "--steps", "6", "--batch-size", "8", "--no-progress", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "test accuracy" in result.stdout
    for rank in range(2):   # one node per cluster: each is its cluster's server
        steps = [json.loads(line) for line in (out / f"metrics-rank{rank}.jsonl").read_text().splitlines()]
        steps = [s for s in steps if s["kind"] == "step"]
        assert [s["cluster"] for s in steps] == [rank] * 6 and [s["server"] for s in steps] == [rank] * 6
        for s in steps:
            exchange = (s["step"] + 1) % 2 == 0
            assert s.get("exchange", False) == exchange
            assert s["intra_cluster_bytes_sent"] == 0
            # Between exchanges nothing leaves a node; at one, its parameters go to the other server.
            assert s["inter_cluster_bytes_sent"] == (LENET_PARAMETERS * 4 + 24 if exchange else 0)
            assert 0 <= s["drift"] < 0.1 if exchange else "drift" not in s
