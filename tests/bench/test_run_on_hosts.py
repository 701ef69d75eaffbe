"""bench.common.run_on_hosts: a benchmark's worker run one rank per host through the launcher (here its
loopback form, torchrun; the emulated hosts need root and are exercised by the benchmarks themselves)."""
import pytest
import torch
import torch.distributed as dist

from bench.common import run_on_hosts


def summed_rank(rank: int, world: int, offset: int) -> tuple[int, int, float, int]:
    """What a rank knows: its rank and world, the group's sum of ranks plus ``offset``, its torch threads."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world, total.item() + offset, torch.get_num_threads()


@pytest.mark.timeout(120)
def test_each_rank_runs_the_worker_in_one_group_and_the_results_come_back_in_rank_order():
    assert run_on_hosts(summed_rank, 3, "loopback", 10) == [(r, 3, 13.0, 1) for r in range(3)]


def failing(rank: int, world: int) -> None:
    raise ValueError(f"rank {rank} refuses")


@pytest.mark.timeout(120)
def test_a_failing_rank_raises_with_its_error():
    with pytest.raises(RuntimeError, match="refuses"):
        run_on_hosts(failing, 2, "loopback")
