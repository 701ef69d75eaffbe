"""Several model files in one directory (hybrid groups, colocated shards, clusters) each keep two
areas; a writer that ran ahead must not overwrite the step the others still hold.

Deterministic: writer 1's file holds step 1 only (its job is held up); writer 0, with writer 1
among its ``other_writers``, checkpoints steps 1, 2, 3 (a checkpoint's step counts the steps
done). Its step-3 checkpoint would replace its step-1 area, the only step the two files share,
so it must wait for writer 1's step 2 instead, and here time out with its file untouched.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.checkpoint import CheckpointError, CheckpointFiles, CheckpointListener
from convoy.checkpoint.files import model_file
from convoy.checkpoint.snapshot import model_layout
from convoy.checkpoint.store import Store
from tests.checkpoint.checkpoint_job import HYPER, STEPS_PER_EPOCH, build_job, train

PEER_TIMEOUT_S = 1.0


def _writer(directory: Path, writer: int, steps: int, other_writers: list[int]) -> CheckpointListener:
    """Train the job ``steps`` steps with a checkpoint after every step into ``model-rank<writer>``."""
    model, engine, x, y = build_job()
    store = Store.create(model_file(directory, writer), model_layout(model, torch.optim.SGD, HYPER))
    files = CheckpointFiles(directory, rank=writer, writer_rank=writer, local_ranks=[writer], model_store=store,
                            other_writers=other_writers, peer_timeout_s=PEER_TIMEOUT_S)
    listener = CheckpointListener(model, engine, files, every=1, last_step=99, full_every=0,
                                  steps_per_epoch=STEPS_PER_EPOCH)
    engine.listeners.append(listener)
    train(model, engine, x, y, 0, steps)
    engine.close()
    return listener


def _steps(directory: Path, writer: int) -> list[int]:
    store = Store.open(model_file(directory, writer))
    try:
        return sorted(store.committed_steps())
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_a_writer_ahead_keeps_the_step_the_other_model_file_holds(tmp_path):
    _writer(tmp_path, 1, 1, []).close()
    assert _steps(tmp_path, 1) == [1]

    ahead = _writer(tmp_path, 0, 3, [1])
    with pytest.raises(CheckpointError, match=r"model-rank1\.ckpt did not reach step 2"):
        ahead.close()
    assert _steps(tmp_path, 0) == [1, 2]   # without the wait the step-1 area went: no step in both files
