"""Kill a checkpointing job at a random moment, resume it, and end bit-identical to an uninterrupted run.

A property over every sync strategy that checkpoints: whatever moment a SIGKILL of
every process of the job lands on (before the first checkpoint, inside a layer's
write, between a rank file's commit and the model file's, during a resume's replay,
after the last step), running the same command again ends with the parameters and
optimizer state of a run that was never interrupted, bit for bit.

Each trial draws its kill from its own seed: either a wall-clock delay after the
start, or a committed step reached plus a short delay (a random point of a later
step). A third of the trials kill the resumed run too, and resume again. The seed
of a failing trial is in the failure message; ``CONVOY_KILL_SEED=S`` replays it.

The default run takes one trial per configuration; the ``slow`` variant
(``CONVOY_KILL_TRIALS=N python -m pytest -m slow tests/checkpoint/test_random_kill.py``)
runs N per configuration.
"""
from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers import convoy_in_process, kill_when, one_line_error, profile_toml

LENET = ("--model", "lenet", "--batch-size", "8", "--seed", "3", "--no-progress", "--lr-schedule", "constant")
# Steps take milliseconds, starting a job seconds: a kill after a step of the first half leaves
# steps to train after the resume (one after the last checkpoint would test nothing).
STEPS = 24
# name -> (flags, model files of a checkpoint). Every combination docs/design.md "What combines"
# allows with --checkpoint-dir; blocktopk and powersgd under allreduce take differential
# checkpoints (their resumes apply the logged steps to the model file; with --checkpoint-rank-files
# full, blocktopk's rank files are written only with the full snapshots and its resume replays the steps).
CONFIGS: dict[str, tuple[tuple[str, ...], int]] = {
    "allreduce": (("--nproc", "2"), 1),
    "allreduce-every3": (("--nproc", "2", "--checkpoint-every", "3"), 1),
    "allreduce-blocktopk-differential": (("--nproc", "2", "--compress", "blocktopk", "--block-fraction", "0.1",
                                          "--checkpoint-full-every", "3"), 1),
    "allreduce-blocktopk-replay": (("--nproc", "2", "--compress", "blocktopk", "--block-fraction", "0.1",
                                    "--checkpoint-full-every", "3", "--checkpoint-rank-files", "full"), 1),
    "allreduce-powersgd-differential": (("--nproc", "2", "--compress", "powersgd", "--checkpoint-full-every", "3"),
                                        1),
    # Checkpoints 3 steps apart, full snapshots spaced by measure: the choice between a log and full
    # snapshots alone (made at the second checkpoint) may fall either way, before or after a kill.
    "allreduce-powersgd-every3-full-auto": (("--nproc", "2", "--compress", "powersgd", "--checkpoint-every", "3"), 1),
    "ps-colocated-blocktopk": (("--nproc", "2", "--sync", "ps", "--servers", "colocated", "--compress",
                                "blocktopk", "--block-fraction", "0.1"), 2),
    "ps-dedicated-powersgd": (("--nproc", "3", "--sync", "ps", "--servers", "1", "--compress", "powersgd"), 1),
    "hierarchical-every1-blocktopk": (("--nproc", "4", "--sync", "hierarchical", "--clusters", "2",
                                       "--exchange-every", "1", "--compress", "blocktopk", "--block-fraction", "0.1"),
                                      2),
    "hierarchical-every2-powersgd": (("--nproc", "4", "--sync", "hierarchical", "--clusters", "2",
                                      "--exchange-every", "2", "--compress", "powersgd"), 2),
    "hybrid": (("--nproc", "3", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1"), 2),
}
RUN_TIMEOUT_S = 600


def _trial_seed(base: int, config: str, trial: int) -> int:
    return zlib.crc32(f"{base}/{config}/{trial}".encode())


def _base_seed() -> int:
    given = os.environ.get("CONVOY_KILL_SEED")
    return int(given) if given else random.SystemRandom().randrange(2 ** 31)


def _differences(expected: Path, got: Path) -> list[str]:
    """Every tensor (parameters, optimizer state) of two model.pt files that is not bit-identical."""
    a, b = torch.load(expected), torch.load(got)
    out = [f"{k} (max diff {(v - b['model'][k]).abs().max().item():.3g})" for k, v in a["model"].items()
           if not torch.equal(v, b["model"][k])]
    for i, (mine, theirs) in enumerate(zip(a["optimizers"], b["optimizers"])):
        for index, state in mine["state"].items():
            out += [f"optimizer {i} param {index} {key}" for key, value in state.items()
                    if torch.is_tensor(value) and not torch.equal(value, theirs["state"][index][key])]
    return out


def _kill_at_random(job: list[str], checkpoints: Path, files: int, rng: random.Random) -> str:
    """Run ``job`` and SIGKILL it at a moment drawn from ``rng``; a description of the moment."""
    if rng.random() < 0.2:   # by the clock: anywhere, also before the first checkpoint or after the end
        delay = rng.uniform(0.0, 4.0)
        killed = kill_when(job, checkpoints, 0, 0, delay, RUN_TIMEOUT_S, forked=True)
        return f"{delay:.2f} s after the start" + ("" if killed else " (the job had ended)")
    step, delay = rng.randrange(1, STEPS // 2), rng.uniform(0.0, 0.05)
    killed = kill_when(job, checkpoints, files, step, delay, RUN_TIMEOUT_S, forked=True)
    return f"{delay * 1000:.0f} ms after step {step} was committed" + ("" if killed else " (the job had ended)")


def _run_trials(tmp_path: Path, name: str, trials: int) -> None:
    flags, files = CONFIGS[name]
    job = [*LENET, *flags, "--steps", str(STEPS)]
    if "hierarchical" in name:   # a given profile: the plan costs no measurement
        (tmp_path / "nodes.toml").write_text(profile_toml(slow=(1, 3)))
        job += ["--node-profile", str(tmp_path / "nodes.toml")]
    whole = convoy_in_process("train", *job, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    base = _base_seed()
    for trial in range(trials):
        seed = _trial_seed(base, name, trial)
        rng = random.Random(seed)
        checkpoints = tmp_path / f"ckpt{trial}"
        resumable = [*job, "--checkpoint-dir", str(checkpoints)]
        moments = [_kill_at_random([*resumable, "--out", str(tmp_path / f"a{trial}")], checkpoints, files, rng)]
        if rng.random() < 1 / 3:   # the resumed run killed too: a kill during a resume's replay
            moments.append(_kill_at_random([*resumable, "--out", str(tmp_path / f"a{trial}b")], checkpoints,
                                           files, rng))
        out = tmp_path / f"b{trial}"
        resumed = convoy_in_process("train", *resumable, "--out", str(out))
        replay = f"config {name}, trial {trial}: CONVOY_KILL_SEED={base} (trial seed {seed}), killed " \
                 + " then ".join(moments)
        assert resumed.returncode == 0, f"{replay}\n{resumed.stderr}"
        where = [line for line in resumed.stderr.splitlines() if "resum" in line]
        diff = _differences(tmp_path / "whole" / "model.pt", out / "model.pt")
        assert not diff, f"{replay}; {where}: not bit-identical to the uninterrupted run: {diff[:6]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_job_killed_at_a_random_moment_resumes_bit_identical(tmp_path, name):
    _run_trials(tmp_path, name, 1)


@pytest.mark.slow
@pytest.mark.timeout(24 * 3600)
@pytest.mark.skipif("CONVOY_KILL_TRIALS" not in os.environ, reason="set CONVOY_KILL_TRIALS=N to run N trials a "
                    "configuration")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_many_random_kills_resume_bit_identical(tmp_path, name):
    _run_trials(tmp_path, name, int(os.environ["CONVOY_KILL_TRIALS"]))


@pytest.mark.timeout(120)
def test_hybrid_ps_has_no_checkpoints_to_kill(tmp_path):
    """hybrid x ps is refused with --checkpoint-dir (the workers' rank files could not commit in
    step with the servers'): nothing to kill, and the refusal is one line."""
    result = convoy_in_process("train", *LENET, "--nproc", "4", "--parallel", "hybrid", "--conv-workers", "2",
                               "--fc-workers", "1", "--sync", "ps", "--servers", "1", "--steps", str(STEPS),
                               "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert "--checkpoint-dir with --sync ps needs" in one_line_error(result)
