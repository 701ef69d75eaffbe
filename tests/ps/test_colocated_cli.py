"""Bad ``--servers``, ``--staleness`` and ``--shard-weights`` values are refused in one line with exit
status 2, before any worker starts; ``--servers colocated`` is the default of ``--sync ps``."""
from __future__ import annotations

import pytest

from convoy.train.config import TrainConfig
from convoy.train.ps import ps_settings
from tests.helpers import convoy_in_process, one_line_error


@pytest.mark.parametrize("args, expected", [
    (["--staleness", "-1"], "--staleness must be a whole number >= 0"),
    (["--staleness", "1.5"], "argument --staleness: invalid int value: '1.5'"),
    (["--staleness", "two"], "argument --staleness: invalid int value: 'two'"),
    (["--servers", "colocated", "--nproc", "1"], "--servers colocated needs at least 2 processes, got 1"),
    (["--nproc", "1"], "--servers colocated needs at least 2 processes, got 1"),   # the default
    (["--servers", "nearby"], "unknown --servers 'nearby'; choose colocated"),
    (["--servers", "1.5"], "unknown --servers '1.5'; choose colocated"),
    (["--servers", "0"], "--servers must be >= 1, got 0"),
    (["--servers", "2", "--staleness", "1"], "--staleness needs --servers colocated"),
    (["--staleness", "1", "--nproc", "1"], "--servers colocated needs at least 2 processes, got 1"),
    (["--staleness", "2", "--compress", "blocktopk"], "--staleness 2 with --compress blocktopk: compressed pushes"),
    (["--clip-grad-norm", "1"], "not supported with --servers colocated yet"),
    (["--shard-weights", "1,0"], "--shard-weights must be numbers > 0, one per rank"),
    (["--shard-weights", "1,x"], "--shard-weights must be numbers > 0, one per rank"),
    (["--shard-weights", "1,nan"], "--shard-weights must be numbers > 0, one per rank"),
    (["--shard-weights", "1,1", "--nproc", "3"], "--shard-weights needs one share per process (3), got 2"),
    (["--shard-weights", "links:1gbit,fast"], "bad link rate 'fast'"),
    (["--shard-weights", "links:1gbit,1gbit", "--nproc", "3"], "--shard-weights needs one share per process (3)"),
    (["--shard-weights", "1,1", "--servers", "1", "--nproc", "2"], "--shard-weights needs --servers colocated"),
])
def test_bad_ps_values_are_one_line_exit_2(args, expected):
    assert expected in one_line_error(convoy_in_process("train", "--sync", "ps", *args))


def test_checkpoints_under_staleness_are_refused_and_leave_no_directory(tmp_path):
    line = one_line_error(convoy_in_process("train", "--sync", "ps", "--staleness", "1", "--checkpoint-dir",
                                            str(tmp_path / "ckpt")))
    assert "--staleness 1 with --checkpoint-dir: checkpoints of a stale job are not supported yet" in line
    assert not (tmp_path / "ckpt").exists()


def test_shard_weights_from_link_rates_are_the_fitted_shares():
    from convoy.ps.sharding import link_shares

    config = TrainConfig.from_flat(sync="ps", nproc=4, shard_weights="links:200mbit,200mbit,200mbit,50mbit")
    settings = ps_settings(config.validate())
    assert settings.shard_weights == tuple(link_shares([200e6, 200e6, 200e6, 50e6]))
    assert settings.shard_weights[3] < 0.02


def test_staleness_and_shard_weights_need_sync_ps():
    assert "need --sync ps" in one_line_error(convoy_in_process("train", "--staleness", "1"))
    assert "need --sync ps" in one_line_error(convoy_in_process("train", "--shard-weights", "1,1"))


def test_a_config_file_integer_is_a_server_count_and_colocated_is_the_default(tmp_path):
    assert TrainConfig.from_flat(sync="ps", nproc=3).validate().ps_servers() == "colocated"
    assert TrainConfig.from_flat(sync="ps", servers=2, nproc=3).validate().ps_servers() == 2
    assert TrainConfig.from_flat(sync="ps", servers="2", nproc=3).validate().ps_servers() == 2
