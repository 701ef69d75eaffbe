"""Sparse compression that converges: momentum correction, the density ramp, fixed-size blocks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.compress import BlockTopKCompressor, LayerInfo, MomentumCorrection, ResidualMemory, TopKCompressor
from convoy.compress.blocks import BlockLayout
from convoy.engine import Engine
from convoy.sync import AllReduce
from tests.compress.helpers import one_layer_bucket, small_mlp, train_steps
from tests.helpers import convoy_in_process, one_line_error


def test_error_feedback_on_the_velocity_conserves_it_exactly():
    """Every step: sent + new residual == old residual + u, u = m u_masked + g (bit for bit)."""
    torch.manual_seed(0)
    m = 0.9
    memory = MomentumCorrection(m)
    strategy = AllReduce(None, BlockTopKCompressor(fraction=0.1, block_size=8), memory)
    bucket = one_layer_bucket((16, 20), (16,))
    velocity = torch.zeros(336)
    for _ in range(12):
        gradient = torch.randn(336)
        bucket.flat_grad().copy_(gradient)
        old_residual = memory.residuals.get("0", torch.zeros(336)).clone()
        sent = strategy.start(bucket, bucket.flat_grad()).wait()
        velocity = velocity * m + gradient
        assert torch.equal(sent + memory.residuals["0"], old_residual + velocity)
        assert 0 < int((sent != 0).sum()) < 336                       # sparse, not dense
        waited = (sent != 0) & (old_residual != 0)
        velocity = velocity.masked_fill(waited, 0.0)                   # momentum factor masking
        assert torch.equal(memory.velocities["0"], velocity)


@pytest.mark.parametrize("compressor", [BlockTopKCompressor(fraction=1.0, block_size=7), TopKCompressor(1.0)])
def test_sending_everything_with_momentum_correction_is_momentum_sgd_exactly(compressor):
    dense, corrected = small_mlp(), small_mlp()
    train_steps(dense, torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4), 8)
    memory = MomentumCorrection(0.9, weight_decay=5e-4)
    engine = Engine(corrected, torch.optim.SGD, AllReduce(None, compressor, memory, warmup_steps=3), lr=0.1)
    train_steps(corrected, engine, 8)
    engine.close()
    for a, b in zip(dense.parameters(), corrected.parameters()):
        assert torch.equal(a, b)


def test_the_warmup_ramps_density_from_a_quarter_down_to_the_target():
    strategy = AllReduce(None, BlockTopKCompressor(fraction=0.01, block_size=4), ResidualMemory(), warmup_steps=4)
    densities = [strategy.warmup_density(step) for step in range(6)]
    assert densities[0] == 0.25 and densities[4:] == [None, None]
    assert all(a > b > 0.01 for a, b in zip(densities[:3], densities[1:4]))
    bucket = one_layer_bucket((400,))
    bucket.flat_grad().copy_(torch.randn(400))
    sent = [int((strategy.start(bucket, bucket.flat_grad()).wait() != 0).sum()) for _ in range(6)]
    assert sent == [100, 44, 20, 8, 4, 4]           # 25 blocks of 4, then ramping to 1 block


def test_fixed_size_blocks_cut_small_and_large_layers_alike():
    layout = BlockLayout([(1024, 1024), (64, 32, 3, 3), (10, 84), (10,)], block_size=256)
    assert [(s.blocks, s.block_size) for s in layout.segments] == [(4096, 256), (72, 256), (4, 210), (1, 10)]
    assert layout.kept_counts(fraction=0.01) == [41, 1, 1, 1]


def test_parameters_below_dense_below_are_sent_whole_and_the_others_cut():
    layout = BlockLayout([(1024, 1024), (10, 1024), (10,)], block_size=16, dense_below=16384)
    assert layout.kept_counts(fraction=0.01) == [655, 640, 1]      # the head and its bias whole
    torch.manual_seed(0)
    shapes = (torch.Size((64, 64)), torch.Size((10, 64)), torch.Size((10,)))
    flat = torch.randn(4096 + 640 + 10)
    compressor = BlockTopKCompressor(fraction=0.01, block_size=16, dense_below=1000)
    sent = compressor.decompress(*compressor.compress(flat, "0", LayerInfo(shapes=shapes)))
    assert torch.equal(sent[4096:], flat[4096:])                  # the small parameters, exactly
    assert int((sent[:4096] != 0).sum()) == 48                     # 1% of 256 blocks: 3 blocks of 16


def test_a_gradient_spike_cannot_leave_in_one_burst():
    """The post-warm-up collapse: when training leaves its plateau, gradients grow a hundredfold in
    a few steps, error feedback banks them for every unsent block, and the blocks leave in bursts
    that, re-applied by momentum, throw the model back to chance. Clipped locally and accumulated
    as a velocity, a worker's exchange after w unsent steps is at most w * clip / (1 - m)."""
    torch.manual_seed(0)
    m, clip = 0.9, 1.0
    memory = MomentumCorrection(m, clip_norm=clip)
    strategy = AllReduce(None, BlockTopKCompressor(fraction=0.05, block_size=5), memory)
    bucket = one_layer_bucket((20, 50))
    for step in range(40):
        spike = 1000.0 if 10 <= step < 14 else 1.0
        bucket.flat_grad().copy_(torch.randn(1000) * spike)
        sent = strategy.start(bucket, bucket.flat_grad()).wait()
        assert float(sent.norm()) <= (step + 1) * clip / (1 - m) + 1e-3
        assert float(memory.velocities["0"].norm()) <= clip / (1 - m) + 1e-3


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       scales=st.lists(st.sampled_from([0.01, 1.0, 30.0]), min_size=5, max_size=5),
       steps=st.integers(1, 3))
def test_local_clipping_is_per_parameter_whatever_the_bucket(sizes, scales, steps):
    """Momentum correction clips each parameter's gradient on its own, so a bucket of several
    parameters computes, bit for bit, what one memory per parameter computes: the engine's
    grouping of layers into buckets is a matter of speed, not of numerics."""
    torch.manual_seed(len(sizes))
    params = [torch.randn(n) for n in sizes]
    grads = [[torch.randn(n) * scale for n, scale in zip(sizes, scales)] for _ in range(steps)]
    bucketed = MomentumCorrection(0.9, clip_norm=1.0, world_size=4, weight_decay=5e-4)
    alone = MomentumCorrection(0.9, clip_norm=1.0, world_size=4, weight_decay=5e-4)
    for step in grads:
        together = bucketed.compensate(torch.cat(step), "0", params)
        apart = [alone.compensate(g.clone(), f"p{i}", [p]) for i, (g, p) in enumerate(zip(step, params))]
        assert torch.equal(together, torch.cat(apart))
        bucketed.update(together, "0", torch.zeros_like(together))
        for i, part in enumerate(apart):
            alone.update(part, f"p{i}", torch.zeros_like(part))


def test_an_fp16_exchange_passes_a_gradient_spike_clipped():
    """convoy train's fp16 memory clips each layer's local gradient before it is accumulated and sent:
    a spike a hundredfold leaves at most clip / (1 - m) per worker, where an fp16 exchange without it
    sent the spike whole (vgg_fc at --lr 0.02 then fell to chance for good, with or without links)."""
    from convoy.compress import FP16Compressor
    from convoy.train.config import TrainConfig
    from convoy.train.optim import build_compression

    config = TrainConfig.from_flat(compress="fp16", model="vgg_fc", lr=0.02).validate()
    compressor, memory = build_compression(config, workers=4)
    assert isinstance(compressor, FP16Compressor) and isinstance(memory, MomentumCorrection)
    strategy, bucket = AllReduce(None, compressor, memory), one_layer_bucket((20, 50))
    m, clip = config.optim.momentum, config.compress.clip_norm / 2   # per worker: clip / sqrt(4 workers)
    torch.manual_seed(0)
    for step in range(30):
        spike = 100.0 if 10 <= step < 14 else 0.01
        bucket.flat_grad().copy_(torch.randn(1000) * spike)
        sent = strategy.start(bucket, bucket.flat_grad()).wait()
        assert float(sent.norm()) <= clip / (1 - m) * (1 + 1e-3)


def test_sparse_sgd_with_momentum_trains_with_momentum_correction_by_default():
    from convoy.train.config import TrainConfig
    from convoy.compress import MomentumCorrection
    from convoy.train.loop import optimizer_spec
    from convoy.train.optim import build_compression

    sparse = TrainConfig.from_flat(compress="blocktopk", block_fraction=0.01, lr=0.05)
    assert optimizer_spec(sparse)[1] == {"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}
    _, memory = build_compression(sparse.validate(), workers=2)
    assert isinstance(memory, MomentumCorrection) and memory.momentum == 0.9 and memory.local_clip is not None
    for config in (TrainConfig(), TrainConfig.from_flat(compress="blocktopk", momentum_correction=False),
                   TrainConfig.from_flat(compress="fp16", momentum_correction=False),
                   TrainConfig.from_flat(compress="topk", optimizer="adam")):
        assert optimizer_spec(config)[1].get("momentum", 0.9) == 0.9


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_block_size_below_one_is_one_line_and_exit_2(value):
    assert "--block-size must be >= 1" in one_line_error(convoy_in_process("train", "--block-size", value))
