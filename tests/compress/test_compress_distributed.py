"""Compressed exchanges on real gloo groups, and the compression options of ``convoy train``."""
from __future__ import annotations

import json
import re
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from convoy.compress import (BlockTopKCompressor, FP16Compressor, NoMemory, PowerSGDCompressor, RandomKCompressor,
                             ResidualMemory, TopKCompressor)
from convoy.engine import Engine
from convoy.errors import UsageError
from convoy.sync import AllReduce
from convoy.train.config import build_config
from tests.helpers import convoy_in_process, digits_batches, flat, one_line_error, run_workers, seeded_model

LR, MOMENTUM = 0.05, 0.9


def _train(rank: int, world: int, strategy: AllReduce, steps: int, model_name: str = "lenet"):
    """Parameters, momentum buffers and per-step bytes after ``steps`` steps of SGD with ``strategy``."""
    model = seeded_model(model_name)
    engine = Engine(model, torch.optim.SGD, strategy, lr=LR, momentum=MOMENTUM, weight_decay=1e-4)
    for x, y in digits_batches(world, rank, 8, steps):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    sent = [engine.stats(s).bytes_sent for s in range(steps)]
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1)
                          for opt in engine.optimizers for p in opt.param_groups[0]["params"]])
    engine.close()
    return flat(model), momentum, sent


def _all_blocks_worker(rank: int, world: int):
    steps = 20
    dense, _, dense_sent = _train(rank, world, AllReduce(dist.new_group()), steps)
    results = {"dense": (dense, dense_sent)}
    for selection in ("local", "global"):
        every = BlockTopKCompressor(blocks_per_layer=10**6, selection=selection)
        params, _, sent = _train(rank, world, AllReduce(dist.new_group(), every, ResidualMemory()), steps)
        results[selection] = (params, sent)
    warm = AllReduce(dist.new_group(), BlockTopKCompressor(1), ResidualMemory(), warmup_steps=3)
    results["warmup"] = (None, _train(rank, world, warm, 5)[2])
    return results


@pytest.mark.timeout(300)
def test_all_blocks_equal_the_dense_all_reduce_and_warmup_steps_are_dense():
    for results in run_workers(_all_blocks_worker, 2):
        dense, dense_sent = results["dense"]
        for selection in ("local", "global"):
            params, sent = results[selection]
            assert (params - dense).abs().max().item() <= 1e-6, selection
        # All blocks kept: the local encoding is all values plus headers, gathered from the peer.
        assert results["local"][1][0] > dense_sent[0] / 2
        warm = results["warmup"][1]
        assert warm[:3] == dense_sent[:3] and warm[3] * 10 < dense_sent[3]


class _UnboundedTopK(TopKCompressor):
    """Declares no payload bound: the strategy must agree on a row width first."""

    def max_payload_bytes(self, ctx):
        return None


def _sparse_worker(rank: int, world: int):
    strategies = {
        "blocktopk": lambda: AllReduce(dist.new_group(), BlockTopKCompressor(1), ResidualMemory()),
        "blocktopk-global": lambda: AllReduce(dist.new_group(), BlockTopKCompressor(fraction=0.05,
                                                                                     selection="global"),
                                              ResidualMemory()),
        "topk": lambda: AllReduce(dist.new_group(), TopKCompressor(0.01), ResidualMemory()),
        "randomk": lambda: AllReduce(dist.new_group(), RandomKCompressor(0.01), ResidualMemory()),
        "blocktopk-no-memory": lambda: AllReduce(dist.new_group(), BlockTopKCompressor(2), NoMemory()),
        "topk-unbounded": lambda: AllReduce(dist.new_group(), _UnboundedTopK(0.01), ResidualMemory()),
    }
    return {name: _train(rank, world, make(), 50) for name, make in strategies.items()}


@pytest.mark.timeout(300)
def test_every_rank_holds_identical_parameters_and_momentum_after_50_sparse_steps():
    results = run_workers(_sparse_worker, 3)
    start = flat(seeded_model("lenet"))
    for name in results[0]:
        params, momentum, sent = results[0][name]
        assert not torch.equal(params, start), name
        for other in results[1:]:
            assert torch.equal(other[name][0], params), name
            assert torch.equal(other[name][1], momentum), name
        assert all(s > 0 for s in sent), name
    assert results[0]["topk-unbounded"][0].equal(results[0]["topk"][0])
    # The seed's k = 1 gathers about 8 kB a step at N = 3, where the dense ring all-reduce sends 330 kB.
    assert max(results[0]["blocktopk"][2]) < 10_000


def _support_worker(rank: int, world: int):
    """Each selection's average of random gradients and the support its exchange reported."""
    shapes = (torch.Size([16, 3, 3, 3]), torch.Size([16]), torch.Size([10, 40]))
    out = {}
    for selection in ("local", "global"):
        sync = AllReduce(dist.new_group(), BlockTopKCompressor(fraction=0.2, selection=selection), ResidualMemory())
        grad = torch.randn(sum(s.numel() for s in shapes), generator=torch.Generator().manual_seed(rank))
        pending = sync.start_flat(0, shapes, grad)
        average = pending.wait()
        out[selection] = (average, *pending.support.ranges())
    return out


@pytest.mark.timeout(120)
def test_a_sparse_exchange_reports_where_its_average_may_be_non_zero():
    """The differential checkpoint reads only the support: every non-zero of the average lies in it."""
    for results in run_workers(_support_worker, 3):
        for selection, (average, starts, lengths) in results.items():
            inside = torch.zeros(average.numel(), dtype=torch.bool)
            for start, length in zip(starts.tolist(), lengths.tolist()):
                inside[start:start + length] = True
            assert average.count_nonzero() > 0, selection
            assert not average.view(torch.int32)[~inside].any(), selection
            assert inside.sum() < average.numel(), selection


def _slowed_train(rank: int, world: int, make: Callable[[], AllReduce], slow_s: float) -> torch.Tensor:
    """Parameters after 6 steps, one bucket per layer; rank 1 sleeps ``slow_s`` per parameter in backward."""
    model = seeded_model("lenet")
    if rank == 1 and slow_s:
        for p in model.parameters():
            # Its layers' exchanges start late, so the other ranks' earlier ones wait in flight
            # while their auxiliary threads compress (and free) the next buckets' tensors.
            p.register_hook(lambda grad: (time.sleep(slow_s), grad)[1])
    engine = Engine(model, torch.optim.SGD, make(), bucket_bytes=0, lr=LR, momentum=MOMENTUM)
    for x, y in digits_batches(world, rank, 8, 6):
        engine.backward(F.cross_entropy(model(x), y))
    engine.synchronize()
    engine.close()
    return flat(model)


def _slow_peer_worker(rank: int, world: int):
    strategies = {
        "fp16": lambda: AllReduce(dist.new_group(), FP16Compressor(), ResidualMemory()),
        "blocktopk": lambda: AllReduce(dist.new_group(), BlockTopKCompressor(fraction=0.1), ResidualMemory()),
        "powersgd": lambda: AllReduce(dist.new_group(), PowerSGDCompressor(2), ResidualMemory()),
    }
    # 20 ms a parameter: a lenet bucket compresses in well under a millisecond, so the other ranks'
    # exchanges wait in flight for rank 1 whatever the machine (10 parameters x 6 steps a strategy).
    return {name: [_slowed_train(rank, world, make, slow_s) for slow_s in (0.0, 0.02)]
            for name, make in strategies.items()}


@pytest.mark.timeout(300)
def test_a_slow_peer_changes_no_bit_of_a_compressed_exchange():
    """Slow links change only timing: exchanges left in flight while later buckets are compressed (a
    summed fp16 wire, gathered rows, PowerSGD's rounds) give the parameters of the same job without the
    delay, on every rank."""
    results = run_workers(_slow_peer_worker, 3)
    for name, (fast, slow) in results[0].items():
        assert not torch.equal(fast, flat(seeded_model("lenet"))), name
        for other in results:
            assert torch.equal(other[name][0], fast) and torch.equal(other[name][1], fast), name


@pytest.mark.parametrize("args,expected", [
    (["--blocks-per-layer", "0"], "--blocks-per-layer must be >= 1"),
    (["--block-fraction", "1.5"], "--block-fraction must be in (0, 1]"),
    (["--block-metric", "l3"], "unknown --block-metric 'l3'; choose one of: l1, l2"),
])
def test_bad_compression_options_are_one_line_and_exit_2(args, expected):
    assert expected in one_line_error(convoy_in_process("train", "--compress", "blocktopk", *args))


@pytest.mark.parametrize("flags,expected", [
    ({"block_fraction": 0.0}, "--block-fraction must be in (0, 1]"),
    ({"block_selection": "ring"}, "choose one of: local, global"),
    ({"blocks_per_layer": 2, "block_fraction": 0.1}, "not both"),
    ({"element_fraction": 2.0}, "--element-fraction must be in (0, 1]"),
    ({"warmup_steps": -1}, "--warmup-steps must be >= 0"),
])
def test_every_compression_option_is_checked_before_training(flags, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        build_config({}, {"compress": "blocktopk", **flags})


@pytest.mark.timeout(300)
def test_train_records_the_compression_ratio_of_every_step(tmp_path):
    out = tmp_path / "run"
    result = convoy_in_process("train", "--compress", "blocktopk", "--block-fraction", "0.02", "--block-metric", "l1",
                               "--warmup-steps", "2", "--dense-below", "0", "--steps", "6", "--out", str(out),
                               "--no-progress")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    ratios = [r["compression_ratio"] for r in records if r["kind"] == "step"]
    # The warm-up ramps density down from 25%: no dense step, and fewer bytes each step until its end.
    assert len(ratios) == 6 and 1.0 < ratios[0] < ratios[1] < min(ratios[2:]) and min(ratios[2:]) > 10
    assert json.loads((out / "config.json").read_text())["compress"]["block_metric"] == "l1"
