"""A waited collective is let go by gloo before convoy lets go of its tensors.

gloo drops its hold on a completed collective on its own thread, a moment after
the waiter wakes; a Python tensor released first is then freed on gloo's thread,
which aborts the process if the interpreter is exiting. Right after a plain
``work.wait()`` gloo still held the tensor in about one collective in five
(2 ranks, this machine), so a few hundred collectives find the race.
"""
import pytest
import torch
import torch.distributed as dist

from convoy.compress import FP16Compressor, NoMemory
from convoy.sync import AllReduce
from convoy.utils.collective import AsyncCollective
from tests.helpers import run_workers

COLLECTIVES = 300


def _held_after_wait(rank: int, world: int) -> dict[str, int]:
    held = {"all_reduce": 0, "all_gather": 0}
    for _ in range(COLLECTIVES):
        wire = torch.full((4096,), float(rank + 1), dtype=torch.float16)
        uses = wire._use_count()
        AsyncCollective(wire, lambda: dist.all_reduce(wire, async_op=True)).wait()
        held["all_reduce"] += wire._use_count() > uses
        rows = [torch.empty(64, dtype=torch.uint8) for _ in range(world)]
        mine = torch.full((64,), rank, dtype=torch.uint8)
        uses = mine._use_count()
        AsyncCollective(mine, lambda: dist.all_gather(rows, mine, async_op=True)).wait()
        held["all_gather"] += mine._use_count() > uses
    return held


@pytest.mark.timeout(120)
def test_gloo_holds_no_tensor_of_a_waited_collective():
    for held in run_workers(_held_after_wait, 2):
        assert held == {"all_reduce": 0, "all_gather": 0}


def _fp16_exchanges(rank: int, world: int) -> list[torch.Tensor]:
    exchange = AllReduce(None, FP16Compressor(), NoMemory())
    averages = []
    for step in range(50):
        grad = torch.arange(1000, dtype=torch.float32) * (rank + 1) / (step + 1)
        averages.append(exchange.start_flat(0, (grad.shape,), grad).wait())
    return averages


@pytest.mark.timeout(120)
def test_an_exchange_waited_for_still_averages_exactly():
    first, second = run_workers(_fp16_exchanges, 2)
    for step, (a, b) in enumerate(zip(first, second)):
        expected = (torch.arange(1000, dtype=torch.float32) * 3 / (step + 1) / 2).half().float()
        assert torch.equal(a, b)
        assert torch.allclose(a, expected, rtol=2e-3)
