"""Bounded staleness (``--staleness S``, colocated servers) on real gloo groups.

Every unit is still updated once per step with the average of all workers' gradients of that step, but
the forward of step t runs on the parameters of step t - S (a fixed delay). A single process applying
that rule to the same batches is the reference; a rank slowed by a sleep shows the others run ahead,
by S steps and never more.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from convoy.errors import UsageError
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps import PSSettings
from tests.helpers import convoy_in_process, digits_batches, flat, ps_groups, run_workers, seeded_model

WORLD, STEPS, BATCH = 3, 10, 8
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
# lenet cut into units over the three shards, those into several slices on two channels in a tight
# window: slices of consecutive steps interleave on the wire.
SMALL_SLICES = {"slice_kb": 16, "credit_kb": 40, "channels": 2}
STALENESS = (1, 2)
SLOW_RANK, SLOW_S = 2, 0.25   # the straggler of the run-ahead test and its sleep per forward


def _layout(rank: int, world: int, staleness: int, priority: str = "graph") -> ParameterServerLayout:
    settings = PSSettings.resolve(servers="colocated", priority=priority, staleness=staleness,
                                  **(SMALL_SLICES if priority == "graph" else {}))
    return ParameterServerLayout(seeded_model("lenet"), settings, rank, world, torch.optim.SGD, HYPER,
                                 torch.zeros(BATCH, 1, 32, 32), groups=ps_groups(settings, world))


def _finish(layout: ParameterServerLayout) -> dict:
    """The model's parameters as the next step would use them, the servers' newest, and whether this rank's
    shard (in storage of its own) holds the newest of its units."""
    layout.engine.synchronize()
    layout.server_engine.synchronize()
    delayed = flat(layout.model)
    units = layout.server_engine.model.params_of
    with layout.engine.sync.newest_parameters():
        newest = flat(layout.model)
        shard_is_newest = all(torch.equal(torch.cat([p.detach().reshape(-1) for p in layout.job.layers[unit][2]]),
                                          torch.cat([p.detach().reshape(-1) for p in params]))
                              for unit, params in units.items())
    storage = {p.data_ptr() for p in layout.model.parameters()}
    apart = not any(p.data_ptr() in storage for params in units.values() for p in params)
    layout.engine.close()
    return {"delayed": delayed, "newest": newest, "shard_is_newest": shard_is_newest, "units": len(units),
            "apart": apart}


def _train(rank: int, world: int, staleness: int, priority: str) -> dict:
    layout = _layout(rank, world, staleness, priority)
    for x, y in digits_batches(world, layout.data_rank, BATCH, STEPS):
        layout.train_step(x, y)
    return _finish(layout)


def _train_with_straggler(rank: int, world: int, staleness: int) -> dict:
    """Each rank's times per step: ``begin``, its first layer's forward has run (after the wait for its
    parameters); ``done``, its forward is complete (before its backward and pushes). The slow rank sleeps
    before each forward."""
    layout = _layout(rank, world, staleness)
    model = layout.model
    first = next(m for m in model.modules() if list(m.parameters(recurse=False)))
    begin: list[float] = []
    done: list[float] = []
    if rank == SLOW_RANK:
        model.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_S))
    first.register_forward_hook(lambda module, args, output: begin.append(time.time()))
    model.register_forward_hook(lambda module, args, output: done.append(time.time()))
    for x, y in digits_batches(world, layout.data_rank, BATCH, STEPS):
        layout.train_step(x, y)
    layout.engine.synchronize()
    layout.server_engine.synchronize()
    layout.engine.close()
    return {"begin": begin, "done": done}


def _job(rank: int, world: int) -> dict:
    runs = {(s, priority): _train(rank, world, s, priority) for s in STALENESS for priority in ("graph", "fifo")}
    runs.update({("straggler", s): _train_with_straggler(rank, world, s) for s in STALENESS})
    return runs


@pytest.fixture(scope="module")
def job():
    return run_workers(_job, WORLD)


def reference(staleness: int) -> list[torch.Tensor]:
    """The parameters of every step 0..STEPS under the fixed-delay rule, in one process.

    Step k's gradient is the mean over the workers' batches of step k of the gradient at the parameters
    of step max(k - S, 0); torch's SGD (momentum, weight decay) applies it to the parameters of step k,
    as each server applies the averaged pushes to its shard.
    """
    current, probe = seeded_model("lenet"), seeded_model("lenet")
    optimizer = torch.optim.SGD(current.parameters(), **HYPER)
    batches = [digits_batches(WORLD, w, BATCH, STEPS) for w in range(WORLD)]
    history = [flat(current)]
    for k in range(STEPS):
        _load(probe, history[max(k - staleness, 0)])
        total = None
        for w in range(WORLD):   # summed in worker order, then averaged, as the server does
            probe.zero_grad()
            x, y = batches[w][k]
            F.cross_entropy(probe(x), y).backward()
            grads = [p.grad.clone() for p in probe.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(current.parameters(), total):
            p.grad = g / WORLD
        optimizer.step()
        history.append(flat(current))
    return history


def _load(model: nn.Module, vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vector[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("priority", ["graph", "fifo"])
@pytest.mark.parametrize("staleness", STALENESS)
def test_stale_colocated_run_equals_the_fixed_delay_reference_after_10_steps(job, staleness, priority):
    history = reference(staleness)
    synchronous = reference(0)[STEPS]
    assert (history[STEPS] - synchronous).abs().max().item() > 1e-4   # the delay changes the run
    for rank in range(WORLD):
        run = job[rank][(staleness, priority)]
        assert (run["newest"] - history[STEPS]).abs().max().item() <= 1e-5, rank
        # The model keeps the parameters the next step's forward would run on: those of step STEPS - S.
        assert (run["delayed"] - history[STEPS - staleness]).abs().max().item() <= 1e-5, rank


@pytest.mark.timeout(180)
@pytest.mark.parametrize("staleness", STALENESS)
def test_each_shard_in_its_own_storage_holds_the_newest_parameters(job, staleness):
    for rank in range(WORLD):
        run = job[rank][(staleness, "graph")]
        assert run["units"] > 0 and run["apart"] and run["shard_is_newest"], rank


@pytest.mark.timeout(180)
@pytest.mark.parametrize("staleness", STALENESS)
def test_fast_ranks_run_s_steps_ahead_of_a_slow_one_and_never_more(job, staleness):
    slow = job[SLOW_RANK][("straggler", staleness)]
    assert len(slow["done"]) == STEPS
    for rank in set(range(WORLD)) - {SLOW_RANK}:
        begin = job[rank][("straggler", staleness)]["begin"]
        # Never more than S ahead: step t's forward needs the update of step t - S - 1, which needs the slow
        # rank's push of that step, which follows its forward.
        assert all(begin[t] > slow["done"][t - staleness - 1] for t in range(staleness + 1, STEPS)), rank
        # Really S ahead: step t starts before the slow rank has finished the forward of step t - S.
        ahead = [t for t in range(staleness + 1, STEPS) if begin[t] < slow["done"][t - staleness]]
        assert len(ahead) >= (STEPS - staleness - 1) // 2, (rank, ahead)


@pytest.mark.timeout(180)
def test_cli_trains_with_staleness_2_and_evaluates_between_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the run folder goes to runs/ under the current directory
    done = convoy_in_process("train", "--model", "lenet", "--batch-size", "8", "--steps", "6", "--eval-every", "3",
                             "--nproc", "3", "--sync", "ps", "--staleness", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    run = next(tmp_path.glob("runs/*/summary.json")).parent
    records = [json.loads(line) for line in (run / "metrics-rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert (run / "model.pt").exists()


def test_the_library_refuses_staleness_with_dedicated_servers():
    with pytest.raises(UsageError, match="--staleness needs --servers colocated"):
        PSSettings.resolve(servers=2, staleness=1)
    assert PSSettings.resolve(servers="colocated", staleness=2).staleness == 2
