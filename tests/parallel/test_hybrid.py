"""Hybrid parallelism: conv group + FC group + link equals one process on the union batch."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from convoy.engine import Engine
from convoy.errors import UsageError
from convoy.parallel import HybridParallel, HybridRoles
from convoy.parallel.groups import ProcessGroups
from convoy.parallel.shape import JobShape
from convoy.sync import AllReduce
from tests.helpers import convoy_in_process, digits, digits_batches, one_line_error, run_workers, seeded_model

STEPS = 6
LR, MOMENTUM = 0.05, 0.9


def _sequential_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4), nn.Conv2d(4, 8, 3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 10))


def _build(name: str) -> nn.Module:
    return _sequential_cnn() if name == "sequential" else seeded_model(name)


def _hybrid_worker(rank: int, world: int, conv: int, fc: int, name: str, batch: int, sub_batches: int):
    roles = HybridRoles(conv, fc)
    groups = ProcessGroups.create(JobShape(world, conv_workers=conv, fc_workers=fc))   # on every rank
    layout = HybridParallel(_build(name), roles, rank, (1, 32, 32),
                            lambda part, group: Engine(part, torch.optim.SGD, AllReduce(group),
                                                       lr=LR, momentum=MOMENTUM), sub_batches=sub_batches,
                            engine_groups=groups.engines)
    batches = digits_batches(conv, layout.data_rank, batch, STEPS)
    per_step = []
    for x, y in batches:
        layout.train_step(x, y)
        layout.engine.synchronize()
        per_step.append(torch.cat([p.detach().reshape(-1) for p in layout.part.parameters()]))
    accuracy = layout.evaluate(torch.utils.data.Subset(_test_set(), range(100)), torch.device("cpu"))
    state = layout.full_state_dict()
    layout.engine.close()
    return per_step, state, accuracy, roles.is_conv(rank)


def _test_set():
    return digits().test


def _reference(name: str, union_batch: int) -> nn.Module:
    model = _build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in digits_batches(1, 0, union_batch, STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize("conv,fc,name,sub_batches", [(2, 1, "vgg_fc", 1), (2, 2, "vgg_fc", 1), (4, 2, "lenet", 1),
                                                      (2, 1, "sequential", 3)])
@pytest.mark.timeout(300)
def test_hybrid_step_equals_one_process_on_the_union_batch(conv, fc, name, sub_batches):
    batch = 4   # with 3 sub-batches: pieces of 2, 1 and 1 samples
    results = run_workers(_hybrid_worker, conv + fc, conv, fc, name, batch, sub_batches)
    reference = _reference(name, conv * batch)
    state = results[0][1]
    for key, value in reference.state_dict().items():
        assert (state[key] - value).abs().max().item() <= 1e-5, key
    for role in (True, False):  # replicas identical within each group, every step
        group = [per_step for per_step, _, _, is_conv in results if is_conv == role]
        for other in group[1:]:
            assert all(torch.equal(a, b) for a, b in zip(group[0], other))
    accuracies = {acc for _, _, acc, _ in results}
    assert len(accuracies) == 1  # every rank reports the same all-reduced score
    with torch.no_grad():
        x = torch.stack([_test_set()[i][0] for i in range(100)])
        y = torch.tensor([int(_test_set()[i][1]) for i in range(100)])
        expected = (reference(x).argmax(1) == y).double().mean().item()
    assert abs(accuracies.pop()[0] - expected) < 1e-9


def test_roles_are_validated():
    with pytest.raises(UsageError, match="divisible"):
        HybridRoles(3, 2)
    with pytest.raises(UsageError, match=">= 1"):
        HybridRoles(0, 1)
    roles = HybridRoles(4, 2)
    assert [roles.fc_of(i) for i in range(4)] == [4, 4, 5, 5]
    assert roles.convs_of(5) == [2, 3]


MODELS = """
import os
from torch import nn

class HeadBomb(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * 30 * 30, 10))
        self.calls = 0

    def forward(self, x):
        return self.classifier(self.features(x))

class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the FC worker ran out of memory")
        return x

def head_bomb():
    model = HeadBomb()
    model.classifier.insert(0, Exploding())
    return model

def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 10))
"""


@pytest.fixture
def user_models(user_module):
    return user_module("hybrid_models", MODELS)


HYBRID = ["train", "--parallel", "hybrid", "--no-progress", "--steps", "10"]


@pytest.mark.parametrize("args,expected", [
    (["--conv-workers", "3", "--fc-workers", "2", "--nproc", "5"], "must be divisible by --fc-workers"),
    (["--conv-workers", "2", "--fc-workers", "1", "--nproc", "4"], "but the job has 4 processes"),
    (["--conv-workers", "2", "--fc-workers", "1", "--nproc", "3", "--model", "hybrid_models:mlp"],
     "no conv/FC boundary"),
    (["--conv-workers", "2", "--fc-workers", "1", "--nproc", "3", "--split-at", "head"],
     "--split-at 'head' names no module"),
])
@pytest.mark.timeout(300)
def test_bad_hybrid_input_is_one_line_and_exit_2(args, expected, user_models):
    assert expected in one_line_error(convoy_in_process(*HYBRID, *args, env=user_models))


@pytest.mark.timeout(300)
def test_an_fc_worker_crash_stops_the_conv_workers(tmp_path, user_models):
    start = time.monotonic()
    result = convoy_in_process(*HYBRID, "--conv-workers", "2", "--fc-workers", "1", "--nproc", "3",
                               "--model", "hybrid_models:head_bomb", "--out", str(tmp_path), env=user_models)
    assert result.returncode == 1
    assert time.monotonic() - start < 60
    assert "rank 2: RuntimeError: the FC worker ran out of memory" in result.stderr
