"""ProcessGroups: the job's groups, created once on every rank, hold the ranks the job's shape says."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from convoy.parallel.groups import ProcessGroups
from convoy.parallel.shape import JobShape
from convoy.ps.settings import PSSettings

# A hybrid job under --sync ps: conv workers 0 and 1, FC worker 2, the server last (3).
SHAPE = JobShape(4, servers=1, conv_workers=2, fc_workers=1)
SETTINGS = PSSettings.resolve(servers=1, priority="graph", channels=2, slice_kb=16, credit_kb=40)


ALL_CHANNELS = [(3, w, c) for w in range(3) for c in range(2)]


def _channel(channels, key: tuple[int, int, int]):
    """The channel's group, or None where this rank is not one of its two ends."""
    try:
        return channels.group(*key)
    except KeyError:
        return None


def _ranks(group) -> list[int] | None:
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _members(rank: int, world: int) -> dict:
    groups = ProcessGroups.create(SHAPE, whole_step=True, bookkeeping=True, ps=SETTINGS, agree_full=True)
    mine = groups.engine_of(SHAPE, rank)
    total = torch.tensor([float(rank)])
    if mine is not None:   # the server trains in neither group
        dist.all_reduce(total, group=mine)   # the groups are matched: each engine group sums its own ranks
    channels = groups.channels
    return {"count": len(groups.engines), "mine": _ranks(mine), "sum": total.item(),
            "whole": _ranks(groups.whole_step), "loop": _ranks(groups.bookkeeping),
            "every": _ranks(groups.agree_every), "full": _ranks(groups.agree_full),
            "ps_workers": _ranks(groups.ps_workers),
            "channels": {key: _ranks(_channel(channels, key)) for key in ALL_CHANNELS
                         if _channel(channels, key) is not None},
            "acks": {pair: _ranks(channels.ack_group(*pair)) for pair in ((0, 3), (1, 3), (2, 3))}}


@pytest.mark.timeout(120)
def test_every_group_holds_the_ranks_the_shape_says():
    from tests.helpers import run_workers

    results = run_workers(_members, 4)
    for rank, got in enumerate(results):
        assert got["count"] == 2   # the conv workers' and the FC workers'
        assert got["mine"] == ([0, 1] if rank < 2 else [2] if rank == 2 else None)
        assert got["whole"] == got["loop"] == got["full"] == [0, 1, 2, 3]
        assert got["every"] is None and got["ps_workers"] is None   # not asked for; hybrid has its engine groups
        want = ALL_CHANNELS if rank == 3 else [(3, rank, 0), (3, rank, 1)]
        assert got["channels"] == {key: [key[1], 3] for key in want}
        assert {p: r for p, r in got["acks"].items() if r is not None} == (
            {(w, 3): [w, 3] for w in range(3)} if rank == 3 else {(rank, 3): [rank, 3]})
    assert [got["sum"] for got in results[:3]] == [1.0, 1.0, 2.0]


def test_without_torch_distributed_no_group_is_created():
    groups = ProcessGroups.create(JobShape(1), whole_step=True, bookkeeping=True)
    assert groups.engines == (None,) and groups.whole_step is None and groups.bookkeeping is None
