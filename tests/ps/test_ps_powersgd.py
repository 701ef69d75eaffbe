"""PowerSGD pushes to a parameter server, on real gloo groups: the same training as all-reduce with PowerSGD.

The workers sum the P round over their own group, so each push carries the
worker's Q_i with the basis P^ they agreed on; the server decodes every row
as P^ Q_i^T and sums in worker order, which equals all-reduce's P^ (sum Q_i)^T
up to the order of the additions.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convoy.compress import PowerSGDCompressor, ResidualMemory
from convoy.engine import Engine
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps import PSSettings
from convoy.sync import AllReduce
from tests.helpers import convoy_in_process, digits_batches, flat, ps_groups, run_workers, seeded_model

WORLD, SERVERS, STEPS, BATCH = 3, 1, 8, 4
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def _powersgd():
    return PowerSGDCompressor(rank=2), ResidualMemory()


def _train_ps(rank: int, world: int) -> torch.Tensor | None:
    settings = PSSettings.resolve(servers=SERVERS, priority="graph", slice_kb=16, channels=2)
    model = seeded_model("lenet")
    compressor, memory = _powersgd()
    layout = ParameterServerLayout(model, settings, rank, world, torch.optim.SGD, HYPER,
                                   torch.zeros(BATCH, 1, 32, 32), compressor=compressor, memory=memory,
                                   groups=ps_groups(settings, world))
    for x, y in digits_batches(world - SERVERS, layout.data_rank, BATCH, STEPS):
        layout.train_step(x, y)
    layout.engine.synchronize()
    layout.engine.close()
    state = layout.full_state_dict()
    return None if state is None else torch.cat([t.reshape(-1) for t in state.values()])


class _ByLayer(AllReduce):
    """All-reduce that names each one-layer bucket by its layer's forward position, as a push does:
    PowerSGD seeds each parameter's first Q from that name."""

    def __init__(self, layers: int, *args):
        super().__init__(*args)
        self.layers = layers

    def start(self, bucket, grad):
        return self.start_flat(self.layers - 1 - bucket.index, tuple(p.shape for p in bucket.params), grad)


def _train_allreduce(rank: int, world: int) -> torch.Tensor | None:
    workers = list(range(SERVERS, world))
    group = dist.new_group(workers)   # every rank takes part in creating it
    if rank not in workers:
        return None
    model = seeded_model("lenet")
    layers = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    engine = Engine(model, torch.optim.SGD, _ByLayer(layers, group, *_powersgd()), bucket_bytes=0, **HYPER)
    for x, y in digits_batches(len(workers), rank - SERVERS, BATCH, STEPS):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    engine.close()
    return flat(model)


def _job(rank: int, world: int) -> dict:
    return {"ps": _train_ps(rank, world), "allreduce": _train_allreduce(rank, world)}


@pytest.mark.timeout(600)
def test_powersgd_pushes_equal_allreduce_with_powersgd():
    results = run_workers(_job, WORLD)
    ps, reference = results[0]["ps"], results[SERVERS]["allreduce"]
    assert (ps - reference).abs().max().item() <= 1e-6
    assert (results[SERVERS + 1]["allreduce"] - reference).abs().max().item() == 0   # workers agree
    assert (reference - flat(seeded_model("lenet"))).abs().max().item() > 1e-3            # it trained


@pytest.mark.timeout(600)
def test_cli_trains_with_powersgd_pushes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the run folder goes to runs/ under the current directory
    done = convoy_in_process("train", "--model", "lenet", "--batch-size", "8", "--steps", "6", "--nproc", "3",
                             "--sync", "ps", "--servers", "1", "--compress", "powersgd")
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.glob("runs/*/model.pt"))
