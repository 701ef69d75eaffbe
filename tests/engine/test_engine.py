"""The engine against single-process and torch DDP references, on real gloo groups."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from convoy.engine import Engine, EngineError, Listener
from convoy.sync import AllReduce
from convoy.sync.base import SyncStrategy
from tests.helpers import digits_batches, flat, run_workers, seeded_model

STEPS = 8
LR, MOMENTUM, WD = 0.05, 0.9, 1e-4


def _engine_and_ddp_worker(rank: int, world: int, name: str, batch: int):
    batches = digits_batches(world, rank, batch, STEPS)
    model = seeded_model(name)
    engine = Engine(model, torch.optim.SGD, AllReduce(dist.new_group()),
                    lr=LR, momentum=MOMENTUM, weight_decay=WD)
    per_step = []
    for x, y in batches:
        engine.backward(F.cross_entropy(model(x), y))
        engine.synchronize()
        per_step.append(flat(model))
    engine.close()

    ddp_model = nn.parallel.DistributedDataParallel(seeded_model(name))
    opt = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        opt.step()
    return per_step, flat(ddp_model.module)


def _single_process_reference(name: str, batch: int) -> torch.Tensor:
    model = seeded_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    for x, y in digits_batches(1, 0, batch, STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return flat(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,name", [(2, "vgg_fc"), (3, "lenet"), (4, "lenet")])
def test_n_workers_equal_one_worker_with_the_union_batch_and_ddp(world, name):
    batch = 4 if name == "vgg_fc" else 6
    results = run_workers(_engine_and_ddp_worker, world, name, batch)
    reference = _single_process_reference(name, batch * world)
    final = [per_step[-1] for per_step, _ in results]
    for params in final:
        assert (params - reference).abs().max().item() <= 1e-5
    for _, ddp_params in results:
        assert (final[0] - ddp_params).abs().max().item() <= 1e-5
    for step in range(STEPS):  # every rank holds identical parameters after every step
        for per_step, _ in results[1:]:
            assert torch.equal(per_step[step], results[0][0][step])


class _Recorder(Listener):
    def __init__(self):
        self.events = []

    def on_layer_updated(self, layer, step):
        self.events.append(("layer", step, layer.index))

    def on_step_end(self, step, stats):
        self.events.append(("step", step, stats.bytes_sent))


def test_listeners_see_every_layer_in_reverse_forward_order_then_the_step_end():
    model = seeded_model("lenet")
    recorder = _Recorder()
    engine = Engine(model, torch.optim.SGD, AllReduce(), listeners=[recorder], lr=0.1)
    for x, y in digits_batches(1, 0, 8, 3):
        engine.backward(F.cross_entropy(model(x), y))
    engine.close()
    layers = list(range(len(engine.layers)))[::-1]
    expected = []
    for step in range(3):
        expected += [("layer", step, i) for i in layers] + [("step", step, 0)]
    assert recorder.events == expected


class _Block(nn.Module):
    """Registers its shortcut after its body, but runs the shortcut first."""

    def __init__(self):
        super().__init__()
        self.body = nn.Conv2d(1, 1, 3, padding=1)
        self.shortcut = nn.Conv2d(1, 1, 1)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        s = self.shortcut(x)
        return self.body(x) + s


def test_layers_follow_forward_order_and_unused_layers_do_not_block():
    torch.manual_seed(0)
    model = _Block()
    engine = Engine(model, torch.optim.SGD, AllReduce(), lr=0.1)
    for _ in range(3):
        engine.backward(model(torch.randn(2, 1, 4, 4)).sum())
    engine.synchronize()
    names = [layer.name for layer in engine.layers]
    assert names == ["unused", "shortcut", "body"]
    engine.close()


class _Failing(SyncStrategy):
    def start(self, layer, grad):
        raise RuntimeError("link down")


def test_a_failing_exchange_raises_in_the_main_thread():
    model = seeded_model("lenet")
    engine = Engine(model, torch.optim.SGD, _Failing(), lr=0.1)
    x, y = digits_batches(1, 0, 4, 1)[0]
    engine.backward(F.cross_entropy(model(x), y))
    with pytest.raises(EngineError, match="link down"):
        model(x)


def test_lr_lambda_scales_every_layer_and_bad_arguments_are_rejected():
    model = seeded_model("lenet")
    engine = Engine(model, torch.optim.SGD, AllReduce(), lr=0.1, lr_lambda=lambda s: 0.5 ** s)
    for x, y in digits_batches(1, 0, 4, 3):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    assert {g["lr"] for opt in engine.optimizers for g in opt.param_groups} == {0.1 * 0.25}
    engine.close()
    with pytest.raises(ValueError, match="nn.Module"):
        Engine(object(), torch.optim.SGD, AllReduce(), lr=0.1)
    with pytest.raises(ValueError, match="Optimizer subclass"):
        Engine(model, dict, AllReduce(), lr=0.1)


def test_a_waiter_reports_a_failure_that_comes_within_the_wait_and_none_after_it():
    import threading
    import time as _time

    from convoy.core.waiting import Waiter
    from convoy.errors import peer_lost

    waiter = Waiter()
    assert waiter.failure_within(0.05) is None
    threading.Timer(0.1, waiter.fail, ("parameter server rank 0 failed", OSError("Connection reset by peer"))).start()
    started = _time.perf_counter()
    assert waiter.failure_within(5.0) == "parameter server rank 0 failed: Connection reset by peer"
    assert _time.perf_counter() - started < 4.0   # woken by the failure, not by the timeout
    assert peer_lost(RuntimeError("x")) is False
    try:
        try:
            raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
        except RuntimeError as lost:
            raise ValueError("wrapped") from lost
    except ValueError as outer:
        assert peer_lost(outer)
