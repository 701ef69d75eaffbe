"""TrainConfig.validate is pure: it returns the job as it runs and changes nothing, not even the config.

Before, validate filled in ``optim.lr``, parsed ``sync.servers``, ``sync.shard_weights`` and
``checkpoint.every`` in place and created the checkpoint directory, so a field's type
depended on whether it had run. Now the config is frozen and validate returns a new one.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from convoy.errors import UsageError
from convoy.train.config import TrainConfig, build_config

GIVEN = [
    dict(model="vgg_fc", compress="topk", sync="ps", nproc=4, servers="colocated", shard_weights="1,1,1,0.25",
         checkpoint_every="4", checkpoint_full_every="auto", logger=["csv"]),
    dict(sync="ps", nproc=3, servers="1", lr=0.1, checkpoint_every="auto", logger=("tensorboard", "csv")),
    dict(model="resnet18", sync="hierarchical", nproc=4, clusters="2"),
    dict(parallel="hybrid", nproc=4, conv_workers=2, fc_workers=1, sync="ps", servers="1"),
]
CHECKPOINTED = GIVEN[:3]   # a hybrid job takes no --checkpoint-dir with --sync ps


@pytest.mark.parametrize("flat", GIVEN)
def test_validate_returns_the_job_and_leaves_the_config_and_the_disk_as_they_were(tmp_path, flat):
    directory = tmp_path / "ckpt"
    config = TrainConfig.from_flat(**flat, checkpoint_dir=str(directory) if flat in CHECKPOINTED else None)
    before = json.dumps(config.to_dict(), sort_keys=True)
    job = config.validate()
    assert json.dumps(config.to_dict(), sort_keys=True) == before
    assert not directory.exists()
    assert isinstance(job.optim.lr, float) and job.optim.lr > 0
    assert job.checkpoint.every == "auto" or isinstance(job.checkpoint.every, int)
    assert isinstance(job.run.logger, tuple)
    assert job.sync.servers in (None, "colocated") or isinstance(job.sync.servers, int)
    assert job.validate() == job   # already resolved: nothing left to resolve
    assert TrainConfig.from_dict(json.loads(json.dumps(job.to_dict()))).validate() == job   # a worker's copy


def test_the_resolved_values():
    job = TrainConfig.from_flat(**GIVEN[0]).validate()
    assert job.optim.lr == pytest.approx(0.0125 * job.compress.sparse_lr_scale)
    assert (job.sync.servers, job.sync.shard_weights) == ("colocated", (1.0, 1.0, 1.0, 0.25))
    assert (job.checkpoint.every, job.checkpoint.full_every, job.run.logger) == (4, "auto", ("csv",))
    assert TrainConfig.from_flat(**GIVEN[1]).validate().sync.servers == 1


def test_a_config_is_frozen_and_changed_by_copy():
    config = TrainConfig.from_flat(steps=20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.run.steps = 40
    longer = config.with_settings(steps=40, checkpoint_dir="ckpt")
    assert (config.run.steps, longer.run.steps, longer.checkpoint.dir) == (20, 40, "ckpt")
    with pytest.raises(TypeError, match="unknown setting 'stepz'"):
        config.with_settings(stepz=1)


def test_build_config_creates_the_checkpoint_directory_once_every_setting_is_good(tmp_path):
    with pytest.raises(UsageError):
        build_config({}, {"checkpoint_dir": str(tmp_path / "refused"), "batch_size": 0})
    assert not (tmp_path / "refused").exists()
    build_config({}, {"checkpoint_dir": str(tmp_path / "made")})
    assert (tmp_path / "made").is_dir()
