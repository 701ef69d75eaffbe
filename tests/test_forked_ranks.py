"""The tests' ranks, forked from one server that imported torch once, start as convoy's launcher starts its own."""
from __future__ import annotations

import os
import re
import tempfile
from datetime import timedelta

import pytest
import torch.distributed as dist

from convoy.utils.spawn import free_port
from tests.helpers import run_workers


def _connect_to_nothing(rank: int, world: int) -> str:
    """What c10d writes on file descriptor 2 while a store client fails to reach a port nobody listens on."""
    with tempfile.TemporaryFile("w+") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            dist.TCPStore("127.0.0.1", free_port(), 1, False, timeout=timedelta(seconds=0.2))
        except RuntimeError:
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return err.read()


@pytest.mark.timeout(60)
def test_a_forked_rank_logs_no_c10d_warnings_as_a_launched_rank():
    # torch reads its C++ log level when it is imported: in the fork server, not in the rank.
    logged = run_workers(_connect_to_nothing, 1)[0]
    assert "timed out" in logged   # c10d's errors still come through
    assert not re.search(r"\[W\d{4} ", logged), logged   # as "[rank0]:[W1128 06:13:00.36 TCPStore.cpp:340] ..."
