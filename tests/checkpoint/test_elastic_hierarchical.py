"""A hierarchical job resumed on another number of workers: its clusters planned again, every rank starting
from the old clusters' state as their next exchange would combine it (convoy.train.elastic_layouts)."""
from __future__ import annotations

import re
import shutil
import signal
import textwrap

import pytest
import torch

from convoy.cluster.contribution import ContributionHistory
from convoy.cluster.plan import clusters_from_tensors
from tests.checkpoint.elastic_helpers import LENET, fingerprint, model_at, rank_state, train
from tests.helpers import convoy_in_process, dying_model, importable, one_line_error, profile_toml, saved_model

# Two clusters of two: {0, 2} and {1, 3} (ranks 1 and 3 slow). Without momentum correction the clusters'
# momentum is in their model files, and blocktopk's error feedback in the rank files: both differ between
# the clusters, and are combined.
JOB = (*LENET, "--sync", "hierarchical", "--clusters", "2", "--exchange-every", "2", "--compress", "blocktopk",
       "--block-fraction", "0.05", "--no-momentum-correction")
STEP = 6   # the checkpoint's step (an exchange step: checkpoints fall on whole cycles)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hierarchical")
    profile = tmp / "slow13.toml"
    profile.write_text(profile_toml(slow=(1, 3)))
    train(4, STEP, tmp / "run", tmp / "ckpt", *JOB, "--node-profile", str(profile))
    return tmp / "ckpt"


def _plan(directory, rank: int, step: int) -> list[list[int]]:
    state = rank_state(directory, rank, step)
    return clusters_from_tensors({k[len("sync.plan."):]: v for k, v in state.items() if k.startswith("sync.plan.")})[0]


def _weights(state: dict[str, torch.Tensor], clusters: list[list[int]]) -> list[float]:
    """The weights the old clusters' next exchange would use: their contribution history's."""
    history = ContributionHistory([len(c) for c in clusters])
    history.agreement_sum = state["sync.contribution.agreement_sum"].tolist()
    history.cycles = int(state["sync.contribution.cycles"])
    return history.weights()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, slow", [(3, (1,)), (2, (1,))])
def test_a_four_worker_job_goes_on_with_new_clusters_from_the_combined_state(checkpoint, tmp_path, world, slow):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    profile = tmp_path / "profile.toml"
    profile.write_text(profile_toml(slow=slow))
    done = train(world, STEP + 2, tmp_path / "run", directory, *JOB, "--node-profile", str(profile))
    assert (f"written by 4 workers; resuming on {world}: global batch 48 kept ({48 // world} per worker), clusters "
            f"planned again") in done.stderr, done.stderr
    assert f"resumed from {directory} at step {STEP}" in done.stderr

    old_clusters = _plan(checkpoint, 0, STEP)
    assert sorted(map(sorted, old_clusters)) == [[0, 2], [1, 3]]
    old = [rank_state(checkpoint, r, STEP) for r in range(4)]
    weights = _weights(old[0], old_clusters)
    assert abs(sum(weights) - 1) < 1e-12 and all(w > 0 for w in weights)
    models = [model_at(checkpoint / f"model-rank{min(c)}.ckpt", STEP) for c in old_clusters]

    # The new world's clusters, kept in every rank file (a restart keeps them) and in the plan file.
    new_clusters = _plan(directory, 0, STEP)
    assert sorted(r for c in new_clusters for r in c) == list(range(world)) and len(new_clusters) == 2
    saved = torch.load(directory / "clusters-rank0.pt", weights_only=True)
    assert clusters_from_tensors(saved)[0] == new_clusters
    assert sorted(p.name for p in directory.glob("model-rank*.ckpt")) == \
        sorted(f"model-rank{min(c)}.ckpt" for c in new_clusters)

    # The model: each cluster's file of the new world holds the same combined state, read at the
    # re-dealt step (beside the step trained since): the parameters, equal in the old clusters at an
    # exchange step, kept bit for bit; the momentum, different in each, their weighted mean.
    for members in new_clusters:
        params, states, _ = model_at(directory / f"model-rank{min(members)}.ckpt", STEP)
        for key, value in params.items():
            assert torch.equal(models[0][0][key], models[1][0][key]), key   # the old clusters agree
            assert torch.equal(value, models[0][0][key]), key
        moved = 0
        for layer, state in states.items():
            for index, tensors in state.items():
                old_momentum = [model[1][layer][index]["momentum_buffer"] for model in models]
                expected = (weights[0] * old_momentum[0].double() + weights[1] * old_momentum[1].double()).float()
                assert torch.equal(tensors["momentum_buffer"], expected), (layer, index)
                moved += int((old_momentum[0] != old_momentum[1]).sum())
        assert moved > 0   # the clusters' momentum did differ: the combination is not a copy

    # Per-rank state: every new rank owes the same combined residual (so does every new cluster, however
    # it was planned): the weighted sum of what each old cluster owed, its members' mean.
    new = [rank_state(directory, r, STEP) for r in range(world)]
    residuals = [k for k in old[0] if k.startswith("sync.residual.")]
    assert residuals
    for key in residuals:
        means = [(old[a][key].double() + old[b][key].double()) / 2 for a, b in old_clusters]
        expected = (weights[0] * means[0] + weights[1] * means[1]).float()
        for rank in range(world):
            assert torch.equal(new[rank][key], expected), (rank, key)
    for rank in range(world):
        assert torch.equal(new[rank]["rng.torch"], old[rank]["rng.torch"])
        assert int(new[rank]["sync.contribution.cycles"]) == 0   # the new clusters' history starts empty

    # The new world's own checkpoint resumes on its own number of workers with its clusters.
    again = train(world, STEP + 4, tmp_path / "run2", directory, *JOB, "--node-profile", str(profile))
    assert f"resumed from {directory} at step {STEP + 2}" in again.stderr and "resuming on" not in again.stderr
    assert _plan(directory, 0, STEP + 4) == new_clusters


# LeNet that sends rank 1 a stop signal (SIGTERM) at its 3rd forward, once: the job stops after a step
# every rank agrees on and commits it, between two exchanges.
STOPPING_MODEL = dying_model(call=3, kill="os.kill(os.getpid(), signal.SIGTERM)")


@pytest.mark.timeout(900)
def test_a_job_stopped_between_exchanges_goes_on_from_the_clusters_combined_parameters(tmp_path):
    (tmp_path / "stopping.py").write_text(textwrap.dedent(STOPPING_MODEL))
    env = {**importable(tmp_path), "CRASH_MARKER": str(tmp_path / "stopped")}
    profiles = {4: tmp_path / "slow13.toml", 3: tmp_path / "slow1.toml"}
    profiles[4].write_text(profile_toml(slow=(1, 3)))
    profiles[3].write_text(profile_toml(slow=(1,)))
    job = (*JOB, "--model", "stopping:factory", "--exchange-every", "10", "--checkpoint-every", "10",
           "--checkpoint-dir", str(tmp_path / "ckpt"))
    stopped = convoy_in_process("train", "--nproc", "4", *job, "--node-profile", str(profiles[4]), "--steps", "20",
                                "--out", str(tmp_path / "a"), env=env)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    step = int(re.search(r"checkpoint committed at step (\d+)", stopped.stderr)[1])
    assert 0 < step < 10   # before the first exchange
    clusters = _plan(tmp_path / "ckpt", 0, step)
    weights = _weights(rank_state(tmp_path / "ckpt", 0, step), clusters)
    models = [model_at(tmp_path / "ckpt" / f"model-rank{min(c)}.ckpt", step)[0] for c in clusters]
    assert any(not torch.equal(models[0][key], models[1][key]) for key in models[0])   # the clusters drifted apart
    # On 3 workers, with no step left to train: the model saved is the one every rank resumed from.
    done = convoy_in_process("train", "--nproc", "3", *job, "--node-profile", str(profiles[3]), "--steps", str(step),
                             "--out", str(tmp_path / "b"), env=env)
    assert done.returncode == 0 and "clusters planned again" in done.stderr, done.stderr
    resumed = saved_model(tmp_path / "b")
    for key, value in models[0].items():
        expected = (weights[0] * value.double() + weights[1] * models[1][key].double()).float()
        assert torch.equal(resumed[key], expected), key


ALLREDUCE = (*LENET, "--compress", "blocktopk", "--block-fraction", "0.05", "--no-momentum-correction")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc, job, expected", [
    (3, ALLREDUCE,
     "was written by a `--sync hierarchical --parallel data` job, not `--sync allreduce --parallel data`"),
    (5, JOB, "global batch of 48 does not divide over 5 workers"),
])
def test_a_hierarchical_checkpoint_that_cannot_be_mapped_is_refused_and_left_untouched(checkpoint, tmp_path, nproc,
                                                                                       job, expected):
    directory = tmp_path / "ckpt"
    shutil.copytree(checkpoint, directory)
    before = fingerprint(directory)
    line = one_line_error(convoy_in_process("train", "--nproc", str(nproc), *job, "--steps", str(STEP + 2),
                                            "--checkpoint-dir", str(directory), "--out", str(tmp_path / "run")))
    assert expected in line
    assert fingerprint(directory) == before
