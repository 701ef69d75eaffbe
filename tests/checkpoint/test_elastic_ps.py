"""A parameter-server job resumed on another number of workers: the servers' shards cut again for the new
world, the workers' state re-dealt (convoy.train.elastic_ps)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from convoy.checkpoint.export import export_checkpoint
from convoy.ps.job import plan_shards
from convoy.ps.roles import PSRoles
from convoy.ps.settings import PSSettings
from tests.checkpoint.elastic_helpers import LENET, assert_mean_kept, fingerprint, rank_state, train
from tests.helpers import convoy_in_process, one_line_error, seeded_model

# Without momentum correction the momentum is the servers' optimizer state, in their shards' files.
JOB = (*LENET, "--sync", "ps", "--compress", "blocktopk", "--block-fraction", "0.05", "--no-momentum-correction",
       "--timeout", "120")
STEP = 5
# 4 ranks that all serve and train (lenet cut in 26 units), and 1 server with 4 workers.
LAYOUTS = {"colocated": (("--servers", "colocated"), 4), "one": (("--servers", "1"), 5)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    servers, nproc = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(f"ps-{request.param}")
    train(nproc, STEP, tmp / "run", tmp / "ckpt", *JOB, *servers)
    return request.param, tmp


def _whole(exported: dict) -> tuple[dict[str, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
    """An export's parameters and momentum by the model's own names, a colocated job's row ranges
    (``fc1[0:30].weight``) put back together in row order."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, value in exported["model"].items():
        match = re.fullmatch(r"(.*)\[(\d+):\d+\](\..*)", key)
        name, start = (match.group(1) + match.group(3), int(match.group(2))) if match else (key, 0)
        pieces.setdefault(name, []).append((start, value))
    params = {name: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for name, parts in pieces.items()}
    momenta: dict[str, list[tuple[int, dict]]] = {}
    for layer, optimizer in zip(exported["layers"], exported["optimizers"]):
        match = re.fullmatch(r"(.*)\[(\d+):\d+\]", layer)
        name, start = (match.group(1), int(match.group(2))) if match else (layer, 0)
        momenta.setdefault(name, []).append((start, optimizer["state"]))
    joined = {name: {i: torch.cat([s[i]["momentum_buffer"] for _, s in sorted(parts, key=lambda p: p[0])])
                     for i in parts[0][1]} for name, parts in momenta.items()}
    return params, joined


@pytest.mark.timeout(900)
@pytest.mark.parametrize("grow", [False, True])
def test_the_model_after_the_resume_is_the_checkpoints_bit_for_bit(checkpoint, tmp_path, grow):
    kind, tmp = checkpoint
    servers, nproc = LAYOUTS[kind]
    # 4 workers to 3 or 6, beside their one server or serving themselves (colocated)
    world = {("colocated", True): 6, ("colocated", False): 3, ("one", True): 7, ("one", False): 4}[kind, grow]
    directory = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", directory)
    before = export_checkpoint(tmp / "ckpt", tmp_path / "before.pt")
    # No step left to train: the model saved is the one the resume restored.
    done = train(world, STEP, tmp_path / "run", directory, *JOB, *servers)
    assert f"written by {nproc} workers; resuming on {world}" in done.stderr, done.stderr
    saved = torch.load(tmp_path / "run" / "model.pt")["model"]
    old_params, old_momenta = _whole(before)
    assert saved.keys() == old_params.keys()
    for key, value in old_params.items():
        assert torch.equal(saved[key], value), key
    # The servers' new files hold the same parameters and optimizer state, cut for the new world.
    new_params, new_momenta = _whole(export_checkpoint(directory, tmp_path / "after.pt"))
    assert new_params.keys() == old_params.keys() and new_momenta.keys() == old_momenta.keys()
    assert old_momenta and all(old_momenta.values())
    for key in old_params:
        assert torch.equal(new_params[key], old_params[key]), key
    for layer, state in old_momenta.items():
        for index, momentum in state.items():
            assert torch.equal(new_momenta[layer][index], momentum), (layer, index)
    if kind == "colocated":
        assert sorted(p.name for p in directory.glob("model-rank*.ckpt")) == \
            sorted(f"model-rank{r}.ckpt" for r in range(world))
    # The workers' residuals, over the whole model: their mean over the workers kept exactly.
    first = 0 if kind == "colocated" else 1
    assert_mean_kept([_by_layer(tmp / "ckpt", r, kind) for r in range(first, nproc)],
                     [_by_layer(directory, r, kind) for r in range(first, world)])
    # The new world trains on from there. Its files keep the re-dealt step beside the new one: they
    # were written with the layout the job's own checkpoints have (a file whose layout changes is
    # created anew, and holds no step until its first commit).
    more = train(world, STEP + 1, tmp_path / "more", directory, *JOB, *servers)
    assert f"resumed from {directory} at step {STEP}" in more.stderr and "resuming on" not in more.stderr
    assert all(rank_state(directory, r, STEP) and rank_state(directory, r, STEP + 1) for r in range(world))


def _by_layer(directory: Path, rank: int, kind: str) -> torch.Tensor:
    """A rank's residuals over the whole model in one order whatever the units: each unit's flat piece
    put back into its layer's parameters (rows), the layers in order."""
    state = rank_state(directory, rank, STEP)
    world = len(list(directory.glob("state-rank*.ckpt")))
    roles = PSRoles.colocate(world) if kind == "colocated" else PSRoles(1, world)
    plan = plan_shards(seeded_model("lenet"), roles, PSSettings.resolve("colocated" if kind == "colocated" else 1))
    layers: dict[int, list[torch.Tensor]] = {}
    for unit, (layer, start, end) in enumerate(plan.units):
        flat, offset = state[f"sync.residual.{unit}"], 0
        params = [p for p in plan.layers[unit][1].parameters(recurse=False) if p.requires_grad]
        whole = layers.setdefault(layer, [torch.zeros(p.shape) for p in params])
        for full, piece in zip(whole, plan.layers[unit][2]):
            rows = flat[offset:offset + piece.numel()].view(piece.shape)
            (full if start is None else full[start:end]).copy_(rows)
            offset += piece.numel()
    return torch.cat([t.reshape(-1) for layer in sorted(layers) for t in layers[layer]])


@pytest.mark.timeout(600)
def test_a_switch_between_colocated_and_dedicated_servers_is_refused_and_changes_nothing(checkpoint, tmp_path):
    kind, tmp = checkpoint
    other = ("--servers", "1") if kind == "colocated" else ("--servers", "colocated")
    directory = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", directory)
    before = fingerprint(directory)
    nproc = LAYOUTS[kind][1]
    line = one_line_error(convoy_in_process("train", "--nproc", str(nproc + 1), *JOB, *other, "--steps", str(STEP),
                                            "--checkpoint-dir", str(directory), "--out", str(tmp_path / "run")))
    assert f"was written by a `--sync ps --servers {'colocated' if kind == 'colocated' else 1}" in line
    assert fingerprint(directory) == before


@pytest.mark.timeout(600)
def test_a_warm_start_of_the_old_cut_or_a_batch_that_does_not_divide_is_refused_and_changes_nothing(tmp_path):
    """PowerSGD keeps a warm start per unit of the shards' cut, which does not survive another cut; and
    the global batch (24 on 2 workers) must divide over the new workers (5)."""
    job = (*LENET, "--sync", "ps", "--compress", "powersgd", "--timeout", "120")
    train(2, 3, tmp_path / "run", tmp_path / "ckpt", *job)
    before = fingerprint(tmp_path / "ckpt")
    for nproc, expected in ((4, "the rank files hold 'sync.powersgd_q."), (5, "global batch of 24 does not divide")):
        line = one_line_error(convoy_in_process("train", "--nproc", str(nproc), *job, "--steps", "5",
                                                "--checkpoint-dir", str(tmp_path / "ckpt"),
                                                "--out", str(tmp_path / "again")))
        assert expected in line
        assert fingerprint(tmp_path / "ckpt") == before
