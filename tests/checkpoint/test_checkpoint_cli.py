"""Checkpoints through the convoy command: resume, inspect, export, bad input, torchrun restarts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import (CLI_TIMEOUT_S, convoy, convoy_in_process, dying_model, importable, one_line_error,
                           same_saved_models)

# 5 steps an epoch on digits with 2 workers: 12 steps cross two epoch boundaries. Without momentum
# correction fp16 keeps the momentum in the optimizers, which same_saved_models compares too.
JOB = ("--nproc", "2", "--batch-size", "128", "--lr-schedule", "constant", "--compress", "fp16",
       "--no-momentum-correction", "--no-progress", "--eval-every", "0")


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """An uninterrupted 12-step run, and one stopped after 7 steps then resumed to 12."""
    tmp = tmp_path_factory.mktemp("resume")
    _train(JOB, 12, tmp / "whole")
    _train(JOB, 7, tmp / "a", tmp / "ckpt")
    return tmp, _train(JOB, 12, tmp / "b", tmp / "ckpt")


def _train(job: tuple[str, ...], steps: int, out: Path, checkpoints: Path | None = None):
    """``convoy train`` of ``job`` for ``steps`` steps into ``out`` (checkpointing into ``checkpoints``);
    it must succeed. Returns the finished process."""
    extra = ("--checkpoint-dir", str(checkpoints)) if checkpoints is not None else ()
    done = convoy_in_process("train", *job, "--steps", str(steps), *extra, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.timeout(600)
def test_two_workers_resume_bit_identically_across_epochs_with_compression_residuals(resumed_run):
    tmp, second = resumed_run
    assert "resumed from" in second.stderr and "at step 7 (epoch 1, batch 2)" in second.stderr
    same_saved_models(tmp / "whole", tmp / "b")


@pytest.mark.timeout(600)
def test_inspect_lists_both_areas_the_file_system_and_sizes(resumed_run):
    tmp, _ = resumed_run
    result = convoy_in_process("checkpoint", "inspect", str(tmp / "ckpt"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "DAX" in out and "model-rank0.ckpt  model, 5 layers" in out
    assert "area A: step 12" in out and "area B: step 11" in out
    assert "state-rank0.ckpt" in out and "state-rank1.ckpt" in out and " MB" in out


@pytest.mark.timeout(600)
def test_export_then_init_from_starts_from_the_checkpoint(resumed_run):
    tmp, _ = resumed_run
    out = tmp / "exported.pt"
    result = convoy("checkpoint", "export", str(tmp / "ckpt"), str(out))
    assert result.returncode == 0, result.stderr
    exported, final = torch.load(out, weights_only=True), torch.load(tmp / "b" / "model.pt")
    assert exported["step"] == 12
    for key, value in final["model"].items():
        assert torch.equal(exported["model"][key], value), key
    run = convoy_in_process("train", "--nproc", "1", "--steps", "1", "--lr", "1e-9", "--momentum", "0",
                            "--weight-decay", "0", "--init-from", str(out), "--out", str(tmp / "init"), "--no-progress")
    assert run.returncode == 0, run.stderr
    started = torch.load(tmp / "init" / "model.pt")["model"]
    for key, value in final["model"].items():
        assert torch.allclose(started[key], value, atol=1e-6), key


def _flip_both_commit_records(directory: Path) -> None:
    path = directory / "model-rank0.ckpt"
    data = bytearray(path.read_bytes())
    header = len(data) - 2 * ((len(data) - 4096) // 2)
    for offset in (header + 40, header + (len(data) - header) // 2 + 40):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut_every_file_in_half(directory: Path) -> None:
    for path in directory.iterdir():
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage", [_flip_both_commit_records, _cut_every_file_in_half],
                         ids=["commit records flipped", "every file cut in half"])
def test_a_damaged_checkpoint_stops_the_job_with_exit_2_and_is_left_untouched(resumed_run, tmp_path, damage):
    tmp, _ = resumed_run
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp / "ckpt", damaged)
    damage(damaged)
    before = {path.name: path.read_bytes() for path in damaged.iterdir()}
    line = one_line_error(convoy_in_process("train", "--nproc", "1", *JOB[2:], "--steps", "14",
                                            "--checkpoint-dir", str(damaged), "--out", str(tmp_path / "r")))
    assert "no usable checkpoint" in line and "nothing was overwritten" in line
    assert {path.name: path.read_bytes() for path in damaged.iterdir()} == before
    inspected = convoy_in_process("checkpoint", "inspect", str(damaged))
    assert inspected.returncode == 1 and "damaged" in inspected.stdout   # 1: nothing recoverable


@pytest.mark.timeout(600)
def test_a_job_stopped_before_every_rank_committed_its_first_checkpoint_starts_over(resumed_run, tmp_path):
    """Killed while its first checkpoint was written: the rank files hold step 2, the model file never
    committed. No step can be restored, so the next start begins at step 0 (saying so) and ends
    bit-identical to the uninterrupted run, instead of refusing a directory nothing could be read from."""
    tmp, _ = resumed_run
    job = (*JOB, "--checkpoint-every", "2")
    _train(job, 2, tmp_path / "a", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-rank0.ckpt").unlink()
    done = _train(job, 12, tmp_path / "b", tmp_path / "ckpt")
    assert "before every rank had committed its first checkpoint; starting from step 0" in done.stderr
    same_saved_models(tmp / "whole", tmp_path / "b")


@pytest.mark.timeout(600)
def test_another_models_checkpoint_is_refused_naming_the_layer(resumed_run, tmp_path):
    tmp, _ = resumed_run
    line = one_line_error(convoy_in_process("train", "--nproc", "1", "--model", "resnet18", "--steps", "2",
                                            "--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp_path / "r")))
    assert "different model" in line and "layer" in line


@pytest.mark.parametrize("make,expected", [
    (lambda d: d.write_text("x"), "is a file, not a directory"),
    (lambda d: None, "cannot be created"),
])
def test_a_bad_checkpoint_dir_is_refused_before_training(tmp_path, make, expected):
    directory = tmp_path / "ckpt"
    make(directory)
    target = str(directory) if expected != "cannot be created" else "/proc/convoy-checkpoint"
    assert expected in one_line_error(convoy_in_process("train", "--checkpoint-dir", target, "--steps", "2"))


@pytest.mark.parametrize("args,expected", [
    (["--checkpoint-every", "0"], "--checkpoint-every must be a whole number from 1 to 1000000000, or auto"),
    (["--checkpoint-every", "often"], "--checkpoint-every must be a whole number from 1 to 1000000000, or auto"),
    (["--checkpoint-dir", "ckpt", "--checkpoint-budget", "0.9"], "--checkpoint-budget must be in (0, 0.5]"),
    (["--checkpoint-dir", "ckpt", "--checkpoint-full-every", "0"],
     "--checkpoint-full-every must be a whole number from 1 to 1000000000, or auto"),
    (["--checkpoint-dir", "ckpt", "--checkpoint-full-every", "seldom"],
     "--checkpoint-full-every must be a whole number from 1 to 1000000000, or auto"),
    (["--resume"], "--resume/--no-resume needs --checkpoint-dir"),
])
def test_bad_checkpoint_options(args, expected):
    assert expected in one_line_error(convoy_in_process("train", *args))


@pytest.mark.timeout(600)
def test_resume_with_nothing_to_resume_is_an_error(tmp_path):
    line = one_line_error(convoy_in_process("train", "--nproc", "1", "--steps", "2", "--resume", "--checkpoint-dir",
                                            str(tmp_path / "empty"), "--out", str(tmp_path / "r"), "--no-progress"))
    assert "holds no checkpoint" in line


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KB tmpfs mounted for the test: too small for a checkpoint or a model.pt."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: root only")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:   # root without the right to mount (a container)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield small
    subprocess.run(["umount", str(small)], check=False)


@pytest.mark.timeout(600)
def test_a_full_disk_is_reported_before_training(small_disk):
    line = one_line_error(convoy_in_process("train", "--nproc", "1", "--steps", "2",
                                            "--checkpoint-dir", str(small_disk), "--out", str(small_disk.parent / "r"),
                                            "--no-progress"))
    assert "MB free" in line or "No space left" in line
    assert list(small_disk.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_run_folder_on_a_full_disk_fails_in_one_line_and_leaves_no_partial_model_file(small_disk):
    """model.pt (lenet and its momentum: about 0.5 MB) does not fit: the run trains, then says so in one
    line; the atomic write leaves no temporary file behind."""
    line = one_line_error(convoy_in_process("train", "--nproc", "1", "--model", "lenet", "--steps", "2",
                                            "--eval-every", "0", "--out", str(small_disk / "run"), "--no-progress"))
    assert "cannot write" in line and "model.pt" in line and "not enough space" in line
    assert sorted(path.name for path in (small_disk / "run").iterdir()) == ["config.json", "metrics-rank0.jsonl"]


CRASHING_MODEL = dying_model(call=6)


@pytest.mark.timeout(600)
def test_a_torchrun_restart_resumes_from_the_last_commit_by_itself(resumed_run, tmp_path):
    """Rank 1 dies at step 5; torchrun restarts both workers; the result equals the uninterrupted run.

    The crashing model is LeNet plus a forward hook: it trains exactly like the fixture's model.
    """
    whole = resumed_run[0] / "whole"
    (tmp_path / "crashing.py").write_text(textwrap.dedent(CRASHING_MODEL))
    # No extra variable: restarted workers must not read their predecessors' keys in torchrun's
    # shared store (convoy.runtime gives every start a store of its own).
    env = {key: value for key, value in os.environ.items()
           if key not in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME")}
    env.update(importable(tmp_path), CRASH_MARKER=str(tmp_path / "crashed"))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", "-m", "convoy", "train", *JOB[2:], "--steps", "12",
                             "--model", "crashing:factory", "--timeout", "30",
                             "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "restarted")],
                            capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "crashed").exists()
    assert "resumed from" in result.stderr
    same_saved_models(whole, tmp_path / "restarted")


# blocktopk (local selection) with momentum correction: residuals and velocities in the rank files
# written with the full snapshots only, rebuilt by replay in between.
SPARSE_JOB = (*JOB[:JOB.index("--compress")], "--compress", "blocktopk",
              *(flag for flag in JOB[JOB.index("--compress") + 2:] if flag != "--no-momentum-correction"),
              "--checkpoint-full-every", "7", "--checkpoint-rank-files", "full")


@pytest.mark.timeout(600)
def test_two_workers_resume_by_replay_and_match_an_uninterrupted_run_residuals_included(tmp_path):
    """Full snapshots after steps 1 and 8 (every 7 checkpoints): a run stopped after step 7 leaves
    its rank files at step 1, and the resume replays steps 2-7 on the log's averages. Both runs'
    rank files then hold step 8 (the resumed run's first checkpoint is a full one) and must agree
    bit for bit, residuals, velocities and RNG of both ranks included, as must the final models."""
    from convoy.checkpoint.recovery import rank_file_tensors

    _train(SPARSE_JOB, 12, tmp_path / "whole", tmp_path / "w")
    _train(SPARSE_JOB, 7, tmp_path / "a", tmp_path / "r")
    assert rank_file_tensors(tmp_path / "r" / "state-rank1.ckpt", "sync", 7) == {}   # only the snapshot's step
    second = _train(SPARSE_JOB, 12, tmp_path / "b", tmp_path / "r")
    assert "resumed from the full snapshot at step 1, replayed 6 steps to step 7" in second.stderr
    for rank in (0, 1):
        kept = {kind: [rank_file_tensors(tmp_path / d / f"state-rank{rank}.ckpt", kind, 8) for d in ("w", "r")]
                for kind in ("sync", "rng")}   # the default model has no buffers
        assert any(key.startswith("velocity.") for key in kept["sync"][0])
        for kind, (mine, theirs) in kept.items():
            assert mine and mine.keys() == theirs.keys(), kind
            for key in mine:
                assert torch.equal(mine[key], theirs[key]), f"rank {rank}: {kind}.{key}"
    x, y = torch.load(tmp_path / "whole" / "model.pt"), torch.load(tmp_path / "b" / "model.pt")
    for key in x["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), key
