"""The convoy command as a user runs it: real processes, real files, exit codes."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

TIMEOUT_S = 120


def convoy(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "convoy", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


def convoy_in_process(*args: str) -> subprocess.CompletedProcess:
    """The convoy command in this process: for input refused before any worker starts,
    without a fresh interpreter importing torch for every case."""
    from convoy.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:   # argparse's own errors
            code = exc.code
    return subprocess.CompletedProcess(["convoy", *args], code, out.getvalue(), err.getvalue())


def _one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


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
    assert expected in _one_line_error(convoy_in_process("train", *args))


def test_config_file_keys_are_checked_and_flags_override(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("learning_rate = 0.1\n")
    assert "unknown key 'learning_rate'" in _one_line_error(convoy("train", "--config", str(bad)))
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text("steps = 'ten'\n")
    assert "steps must be int" in _one_line_error(convoy("train", "--config", str(wrong_type)))
    good = tmp_path / "good.toml"
    good.write_text("steps = 3\nbatch-size = 8\nmodel = 'lenet'\nlr = 1\n")
    out = tmp_path / "run"
    result = convoy("train", "--config", str(good), "--lr", "0.01", "--out", str(out), "--nproc", "1")
    assert result.returncode == 0, result.stderr
    import json
    saved = json.loads((out / "config.json").read_text())
    assert (saved["run"]["steps"], saved["data"]["batch_size"], saved["optim"]["lr"]) == (3, 8, 0.01)


def test_help_documents_every_option():
    from convoy.train.config import config_settings

    result = convoy("train", "--help")
    assert result.returncode == 0
    for setting in config_settings():
        assert setting.flag in result.stdout
    assert "torchrun" in result.stdout


def test_train_writes_a_run_folder_and_is_bit_reproducible(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = convoy("train", "--steps", "12", "--eval-every", "5", "--out", str(out), "--no-progress")
        assert result.returncode == 0, result.stderr
        summary = result.stdout.strip().splitlines()[-1]
        assert summary.startswith("convoy: 12 steps in") and "test accuracy" in summary
        assert "MB sent per worker" in summary
        runs.append(torch.load(out / "model.pt")["model"])
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key
    records = [line for line in (tmp_path / "a" / "metrics-rank1.jsonl").read_text().splitlines()]
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
def failing_model(tmp_path):
    (tmp_path / "bomb.py").write_text(textwrap.dedent(FAILING_MODEL))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_failing_worker_stops_the_local_job_quickly(tmp_path, failing_model):
    start = time.monotonic()
    result = convoy("train", "--model", "bomb:factory", "--steps", "50", "--out", str(tmp_path / "r"),
                    "--no-progress", env=failing_model)
    assert result.returncode == 1
    assert time.monotonic() - start < 60
    assert "rank 1: RuntimeError: rank one exploded" in result.stderr


def test_a_failing_worker_stops_a_torchrun_job(tmp_path, failing_model):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "convoy", "train", "--model", "bomb:factory", "--steps", "50", "--no-progress",
         "--timeout", "30", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, env={**os.environ, **failing_model}, timeout=TIMEOUT_S)
    assert result.returncode != 0
    assert time.monotonic() - start < 90
    assert "rank one exploded" in result.stderr


def test_a_missing_data_file_is_reported_by_name(tmp_path):
    line = _one_line_error(convoy("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--nproc", "1"))
    assert str(tmp_path) in line and "train-images-idx3-ubyte" in line


def test_plot_writes_pngs_from_a_real_run(tmp_path):
    out = tmp_path / "run"
    assert convoy("train", "--steps", "6", "--out", str(out), "--no-progress").returncode == 0
    result = convoy("plot", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("loss.png", "accuracy.png", "bytes.png", "step_time.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
