"""The convoy command as a user runs it: real processes, real files, exit codes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import CLI_TIMEOUT_S, convoy, convoy_in_process, one_line_error, saved_model


@pytest.mark.parametrize("args,expected", [
    (["--model", "alexnet"], "choose one of: lenet, vgg_fc, resnet18"),
    (["--dataset", "imagenet"], "choose one of: digits, mnist, cifar10, synthetic"),
    (["--sync", "gossip"], "choose one of: allreduce"),
    (["--optimizer", "lion"], "choose one of: sgd, adam"),
    (["--compress", "zip"], "choose one of: none"),
    (["--parallel", "pipeline"], "choose one of: data"),
    (["--nproc", "0"], "--nproc must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "2", "--epochs", "1"], "not both"),
    (["--batch-size", "many"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
    assert expected in one_line_error(convoy_in_process("train", *args))


@pytest.mark.timeout(300)
def test_config_file_keys_are_checked_and_flags_override(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("learning_rate = 0.1\n")
    assert "unknown key 'learning_rate'" in one_line_error(convoy_in_process("train", "--config", str(bad)))
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text("steps = 'ten'\n")
    assert "steps must be int" in one_line_error(convoy_in_process("train", "--config", str(wrong_type)))
    good = tmp_path / "good.toml"
    good.write_text("steps = 3\nbatch-size = 8\nmodel = 'lenet'\nlr = 1\n")
    out = tmp_path / "run"
    result = convoy_in_process("train", "--config", str(good), "--lr", "0.01", "--out", str(out), "--nproc", "1")
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "config.json").read_text())
    assert (saved["run"]["steps"], saved["data"]["batch_size"], saved["optim"]["lr"]) == (3, 8, 0.01)


def test_help_documents_every_option():
    from convoy.train.config import config_settings

    result = convoy_in_process("train", "--help")
    assert result.returncode == 0
    for setting in config_settings():
        assert setting.flag in result.stdout
    assert "torchrun" in result.stdout


@pytest.fixture(scope="module")
def twice_trained(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The same 12-step job run twice: by the convoy command in a new process, and with this process as launcher."""
    tmp = tmp_path_factory.mktemp("twice")
    job = ("train", "--steps", "12", "--eval-every", "5", "--no-progress")
    return tmp, {"a": convoy(*job, "--out", str(tmp / "a")), "b": convoy_in_process(*job, "--out", str(tmp / "b"))}


@pytest.mark.timeout(300)
def test_train_writes_a_run_folder_and_is_bit_reproducible(twice_trained):
    tmp, results = twice_trained
    for result in results.values():
        assert result.returncode == 0, result.stderr
        summary = result.stdout.strip().splitlines()[-1]
        assert summary.startswith("convoy: 12 steps in") and "test accuracy" in summary
        assert "MB sent per worker" in summary
    runs = [saved_model(tmp / name) for name in results]
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key
    records = [line for line in (tmp / "a" / "metrics-rank1.jsonl").read_text().splitlines()]
    assert sum('"kind": "step"' in r for r in records) == 12
    assert sum('"kind": "eval"' in r for r in records) == 3  # steps 5, 10 and the end


FAILING_MODEL = """
import os
import torch
from torch import nn

class Bomb(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(1, 2, 3)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * 30 * 30, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if os.environ["RANK"] == "1" and self.calls == 4:
            raise RuntimeError("rank one exploded")
        return self.classifier(self.features(x))

def factory():
    return Bomb()
"""


@pytest.fixture
def failing_model(user_module):
    return user_module("bomb", textwrap.dedent(FAILING_MODEL))


@pytest.mark.timeout(300)
def test_a_failing_worker_stops_the_local_job_quickly(tmp_path, failing_model):
    start = time.monotonic()
    result = convoy_in_process("train", "--model", "bomb:factory", "--steps", "50", "--out", str(tmp_path / "r"),
                               "--no-progress", env=failing_model)
    assert result.returncode == 1
    assert time.monotonic() - start < 60
    assert "rank 1: RuntimeError: rank one exploded" in result.stderr


@pytest.mark.timeout(300)
def test_a_failing_worker_stops_a_torchrun_job(tmp_path, failing_model):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "convoy", "train", "--model", "bomb:factory", "--steps", "50", "--no-progress",
         "--timeout", "30", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, env={**os.environ, **failing_model}, timeout=CLI_TIMEOUT_S)
    assert result.returncode != 0
    assert time.monotonic() - start < 90
    assert "rank one exploded" in result.stderr


# LeNet that, at its first forward in a worker (past the rendezvous: the store and gloo's connections
# are up), writes the addresses its process listens on to $LISTENING_DIR/rank<RANK>.json.
LISTENING_MODEL = """
import json
import os
from pathlib import Path

import psutil
from convoy.models.lenet import lenet

def factory():
    model = lenet()

    def note(module, args):
        path = Path(os.environ["LISTENING_DIR"], f"rank{os.environ.get('RANK')}.json")
        if "RANK" in os.environ and not path.exists():
            sockets = psutil.Process().net_connections("inet")
            path.write_text(json.dumps([s.laddr.ip for s in sockets if s.status == psutil.CONN_LISTEN]))

    model.register_forward_pre_hook(note)
    return model
"""


@pytest.mark.timeout(120)
def test_a_local_run_listens_on_loopback_only(tmp_path, user_module):
    """Nothing another machine could connect to: rank 0's rendezvous store (torch's default listens on
    every interface) and every rank's gloo sockets bind 127.0.0.1 (or ::1)."""
    env = {**user_module("listening", LISTENING_MODEL), "LISTENING_DIR": str(tmp_path)}
    result = convoy_in_process("train", "--nproc", "2", "--model", "listening:factory", "--steps", "2",
                               "--eval-every", "0", "--no-progress", "--out", str(tmp_path / "run"), env=env)
    assert result.returncode == 0, result.stderr
    listening = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert listening[0], "rank 0 listens on nothing: the store was not up at the first step"
    assert all(ip in ("127.0.0.1", "::1") for ips in listening.values() for ip in ips), listening


@pytest.mark.timeout(300)
def test_a_missing_data_file_is_reported_by_name(tmp_path):
    line = one_line_error(convoy_in_process("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--nproc", "1"))
    assert str(tmp_path) in line and "train-images-idx3-ubyte" in line


@pytest.mark.timeout(300)
def test_plot_writes_pngs_from_a_real_run(twice_trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(twice_trained[0] / "a", out)
    result = convoy("plot", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("loss.png", "accuracy.png", "bytes.png", "step_time.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
