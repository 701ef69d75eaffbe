"""The job's shape (convoy.parallel.shape): roles, data world and groups, checked once, up front."""
from __future__ import annotations

import re

import pytest

from convoy.errors import UsageError
from convoy.parallel.shape import JobShape
from tests.helpers import convoy_in_process


def test_data_parallel_ps_and_hybrid_shapes():
    data = JobShape(4, clusters=2)
    assert data.data_world_size == 4 and data.engine_groups == [[0, 1, 2, 3]] and data.data_rank(3) == 3
    ps = JobShape(3, servers=1)
    assert ps.workers == [1, 2] and ps.data_rank(0) == 0 and ps.data_rank(2) == 1
    hybrid = JobShape(5, conv_workers=4, fc_workers=1, clusters=2)
    assert hybrid.data_world_size == 4 and hybrid.engine_groups == [[0, 1, 2, 3], [4]]
    assert hybrid.clusters_in([4]) == 1 and hybrid.clusters_in([0, 1, 2, 3]) == 2   # a group of one just trains
    assert hybrid.hybrid_roles().fc_of(3) == 4 and hybrid.data_rank(4) == 0


@pytest.mark.parametrize("shape, message", [
    (dict(world_size=4, conv_workers=2, fc_workers=1), "--conv-workers + --fc-workers = 3 but the job has 4"),
    (dict(world_size=3, conv_workers=2, fc_workers=1, clusters=3), "--clusters 3 is more than the 2 conv workers"),
    (dict(world_size=6, conv_workers=3, fc_workers=3, clusters=4), "--clusters 4 is more than the 3 conv workers"),
    (dict(world_size=2, servers=2), "--servers (2) must be smaller than the number of processes (2)"),
])
def test_shapes_that_do_not_fit_the_world_are_refused_in_one_line(shape, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        JobShape(**shape)


def test_the_cli_refuses_a_bad_shape_before_any_worker_starts():
    result = convoy_in_process("train", "--nproc", "3", "--parallel", "hybrid", "--conv-workers", "2",
                               "--fc-workers", "1", "--sync", "hierarchical", "--clusters", "3")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--clusters 3 is more than the 2 conv workers" in line


def test_hybrid_servers_come_after_the_conv_and_fc_workers():
    shape = JobShape(4, servers=1, conv_workers=2, fc_workers=1)
    assert shape.engine_groups == [[0, 1], [2]] and shape.workers == [0, 1]
    with pytest.raises(UsageError, match=re.escape("--conv-workers + --fc-workers + --servers = 4 but the job has 3")):
        JobShape(3, servers=1, conv_workers=2, fc_workers=1)
