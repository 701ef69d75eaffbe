"""Compressors in one process: block shapes, metrics, error feedback, global-momentum SGD."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from convoy.compress import (BlockLayout, BlockTopKCompressor, FP16Compressor, LayerInfo, MomentumCorrection,
                             RandomKCompressor, ResidualMemory, TopKCompressor, build_compressor)
from convoy.compress.blocks import cut
from convoy.engine import Engine
from convoy.engine.layers import Bucket, Layer
from convoy.errors import UsageError
from convoy.sync import AllReduce


def _kept(compressor, flat, shapes):
    """Flat indices of the non-zero values ``compressor`` sends of ``flat``."""
    payload, ctx = compressor.compress(flat, "layer", LayerInfo(shapes=tuple(torch.Size(s) for s in shapes)))
    sent = compressor.decompress(payload, ctx)
    assert torch.equal(sent[sent != 0], flat[sent != 0])  # kept values travel unchanged
    return torch.nonzero(sent).flatten().tolist()


def test_blocks_are_filters_rows_and_bias_elements():
    assert cut((8, 3, 3, 3)) == (8, 27)      # conv weight: one filter per block
    assert cut((10, 84)) == (10, 84)         # linear weight: one output neuron's row
    assert cut((10,)) == (10, 1)             # bias: one element per block
    assert cut(()) == (1, 1)                 # scalar parameter
    assert cut((3, 1, 2, 5)) == (3, 10)      # odd shapes are cut along dim 0
    assert cut((0, 4)) == (0, 1)             # empty
    layout = BlockLayout([(4, 2, 3, 3), (4,), (3, 5), (), (2, 1, 1, 3)])
    assert [(s.offset, s.blocks, s.block_size) for s in layout.segments] == \
        [(0, 4, 18), (72, 4, 1), (76, 3, 5), (91, 1, 1), (92, 2, 3)]
    assert layout.numel == 98 and layout.total_blocks == 14


def test_the_chosen_block_is_exactly_the_seed_slice_of_each_parameter():
    shapes = [(4, 2, 3, 3), (4,), (3, 5), (), (2, 1, 1, 3)]
    flat = torch.full((98,), 0.01)
    flat[2 * 18:3 * 18] = 1.0    # conv filter 2
    flat[72 + 3] = -5.0          # bias element 3 (magnitude counts)
    flat[76 + 5:76 + 10] = -2.0  # linear row 1
    flat[91] = 0.5               # the scalar
    flat[92 + 3:92 + 6] = 3.0    # odd parameter, block 1
    kept = _kept(BlockTopKCompressor(blocks_per_layer=1), flat, shapes)
    expected = (list(range(36, 54)) + [75] + list(range(81, 86)) + [91] + list(range(95, 98)))
    assert kept == expected


def test_l1_and_l2_choose_differently_on_hand_built_blocks():
    # Row 0: four values of 3 (L1 12, L2 6). Row 1: one value of 10 (L1 10, L2 10).
    flat = torch.tensor([3.0, 3.0, 3.0, 3.0, 10.0, 0.0, 0.0, 0.0])
    assert _kept(BlockTopKCompressor(1, metric="l1"), flat, [(2, 4)]) == [0, 1, 2, 3]
    assert _kept(BlockTopKCompressor(1, metric="l2"), flat, [(2, 4)]) == [4]


def test_fraction_keeps_a_rounded_share_at_least_one_block_and_k_caps_at_all_blocks():
    layout = BlockLayout([(120, 4), (7,)])
    scores = torch.arange(127, dtype=torch.float32)
    assert [k.numel() for k in layout.select(scores, fraction=0.01)] == [1, 1]
    assert [k.numel() for k in layout.select(scores, fraction=0.5)] == [60, 4]
    assert [k.tolist() for k in layout.select(scores, count=2)] == [[118, 119], [5, 6]]
    assert [k.numel() for k in layout.select(scores, count=10**6)] == [120, 7]
    flat = torch.randn(layout.numel)
    c = BlockTopKCompressor(blocks_per_layer=10**6)
    assert torch.equal(c.decompress(*c.compress(flat, "x", LayerInfo(shapes=layout.shapes))), flat)


@pytest.mark.parametrize("compressor", [
    BlockTopKCompressor(1), BlockTopKCompressor(fraction=0.3, metric="l2"),
    BlockTopKCompressor(2, selection="global"), TopKCompressor(0.05), RandomKCompressor(0.05), FP16Compressor(),
], ids=["blocktopk", "blocktopk-l2", "blocktopk-global", "topk", "randomk", "fp16"])
def test_error_feedback_conserves_the_gradient_exactly(compressor):
    memory = ResidualMemory()
    info = LayerInfo(shapes=(torch.Size([6, 3, 3, 3]), torch.Size([6])))
    torch.manual_seed(0)
    for _ in range(5):
        grad = torch.randn(168)
        old = memory.residuals.get("l", torch.zeros(168))
        compensated = memory.compensate(grad, "l")
        payload, ctx = compressor.compress(compensated, "l", info)
        sent = compressor.decompress(payload, ctx)
        memory.update(compensated, "l", sent)
        assert torch.equal(sent + memory.residuals["l"], grad + old)
        if not isinstance(compressor, FP16Compressor):  # sent blocks leave no residual
            assert torch.equal(memory.residuals["l"][sent != 0], torch.zeros(int((sent != 0).sum())))


@pytest.mark.parametrize("compressor", [
    BlockTopKCompressor(1), BlockTopKCompressor(2, selection="global"), TopKCompressor(0.05),
    RandomKCompressor(0.05), FP16Compressor(),
], ids=["blocktopk", "blocktopk-global", "topk", "randomk", "fp16"])
def test_decompress_add_equals_adding_the_dense_tensor(compressor):
    info = LayerInfo(shapes=(torch.Size([6, 3, 3, 3]), torch.Size([6])))
    torch.manual_seed(1)
    payload, ctx = compressor.compress(torch.randn(168), "l", info)
    base = torch.randn(168)
    assert torch.equal(compressor.decompress_add(payload, ctx, base.clone()), base + compressor.decompress(payload, ctx))


def test_topk_and_randomk_send_their_share():
    flat = torch.tensor([0.1, -4.0, 0.2, 3.0, 0.0, 0.5, -0.3, 0.05, 1.0, 0.0])
    top = TopKCompressor(0.2)
    assert torch.nonzero(top.decompress(*top.compress(flat, "x"))).flatten().tolist() == [1, 3]
    rand = RandomKCompressor(0.3)
    first, second = rand.compress(flat, "x"), rand.compress(flat, "x")
    assert first[0][0].numel() == 3
    assert not torch.equal(first[1][0], second[1][0])               # a new draw each step
    assert torch.equal(RandomKCompressor(0.3).compress(flat, "x")[1][0], first[1][0])  # same on every rank
    resumed = RandomKCompressor(0.3).compress(flat, "x", LayerInfo(step=1))  # the step seeds the draw
    assert torch.equal(resumed[1][0], second[1][0])


def test_bad_arguments_are_rejected_up_front():
    for kwargs, message in [({"blocks_per_layer": 0}, ">= 1"), ({"fraction": 0.0}, r"\(0, 1\]"),
                            ({"fraction": 1.5}, r"\(0, 1\]"), ({"metric": "l3"}, "l1, l2"),
                            ({"selection": "ring"}, "local, global"),
                            ({"blocks_per_layer": 1, "fraction": 0.1}, "not both")]:
        with pytest.raises(ValueError, match=message):
            BlockTopKCompressor(**kwargs)
    with pytest.raises(ValueError, match="hold 12 values"):
        BlockTopKCompressor().compress(torch.zeros(5), "x", LayerInfo(shapes=(torch.Size([3, 4]),)))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        TopKCompressor(0)
    with pytest.raises(UsageError, match="choose one of: none, fp16, blocktopk, topk, randomk, powersgd"):
        build_compressor("zip")
    with pytest.raises(ValueError, match="warmup_steps"):
        AllReduce(warmup_steps=-1)


def test_the_engine_update_is_global_momentum_sgd_on_the_sparse_gradient():
    """V = m V + G, w = w - lr V, with G the (decompressed) sparse gradient: torch SGD, dampening 0."""
    lr, m = 0.1, 0.9
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    reference = [p.detach().clone() for p in model.parameters()]
    engine = Engine(model, torch.optim.SGD, AllReduce(None, BlockTopKCompressor(1), ResidualMemory()),
                    lr=lr, momentum=m)
    layers = [[0, 1], [2, 3]]          # parameter indices of each layer
    compressor, memory = BlockTopKCompressor(1), ResidualMemory()
    velocity = [torch.zeros_like(p) for p in reference]
    for step in range(6):
        x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 5, (8,))
        params = [p.requires_grad_() for p in reference]
        grads = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(
            model, dict(zip([n for n, _ in model.named_parameters()], params)), (x,)), y), params)
        engine.backward(F.cross_entropy(model(x), y))
        engine.synchronize()
        for name, idx in enumerate(layers):
            flat = memory.compensate(torch.cat([grads[i].reshape(-1) for i in idx]), str(name))
            info = LayerInfo(shapes=tuple(reference[i].shape for i in idx))
            sent = compressor.decompress(*compressor.compress(flat, str(name), info))
            memory.update(flat, str(name), sent)
            for i, g in zip(idx, sent.split([reference[i].numel() for i in idx])):
                velocity[i] = m * velocity[i] + g.view_as(reference[i])
                reference[i] = (reference[i] - lr * velocity[i]).detach()
        for p, ref in zip(model.parameters(), reference):
            assert (p.detach() - ref).abs().max().item() <= 1e-6
    engine.close()


def test_warmup_counts_job_steps_so_a_resumed_job_does_not_warm_up_again():
    layer = nn.Linear(4, 3)
    bucket = Bucket(0, [Layer(0, "fc", layer, list(layer.parameters()))])
    for p in layer.parameters():
        p.grad = torch.randn_like(p)
    bucket.attach_grads()
    strategy = AllReduce(None, BlockTopKCompressor(1), ResidualMemory(), warmup_steps=2)
    assert torch.equal(strategy.start(bucket, bucket.flat_grad()).wait(), bucket.flat_grad())  # dense
    assert not strategy.memory.residuals["0"].any()   # the dense warm-up holds nothing back
    strategy.set_step(2)
    sparse = strategy.start(bucket, bucket.flat_grad()).wait()
    assert int((sparse != 0).sum()) == 4 + 1 and strategy.memory.residuals["0"].any()  # one row, one bias


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_fp16_payloads_of_huge_gradients_sum_to_finite_values_and_the_residual_keeps_the_rest(world):
    """Values past fp16's range used to become inf, and inf - inf NaN in the sum and the residual,
    which error feedback then carried into every later step."""
    from convoy.compress.fp16 import FP16_MAX, share_limit

    gradient = torch.tensor([1e6, -3e5, 7e4, 65504.0, 1.0, -2.5e-8, 0.0])
    compressor, memory = FP16Compressor(), ResidualMemory()
    info = LayerInfo(world_size=world)
    payload, ctx = compressor.compress(gradient, "0", info)
    sent = compressor.decompress(payload, ctx)
    memory.update(gradient, "0", sent)
    # Every rank sending the largest share: the fp16 sum, in any order, stays finite.
    total = torch.zeros_like(payload[0])
    for _ in range(world):
        total += payload[0]
    assert torch.isfinite(total).all() and float(total.abs().max()) <= FP16_MAX
    assert float(sent.abs().max()) == share_limit(world) and world * share_limit(world) <= FP16_MAX
    # Exact error feedback: what was clamped or rounded away is in the residual, to the bit.
    assert torch.isfinite(memory.residuals["0"]).all()
    assert torch.equal(sent + memory.residuals["0"], gradient)
    # Next step: a residual too large for one step leaves over the following ones, nothing lost.
    for _ in range(200):
        compensated = memory.compensate(torch.zeros(7), "0")
        payload, ctx = compressor.compress(compensated, "0", info)
        memory.update(compensated, "0", compressor.decompress(payload, ctx))
    assert float(memory.residuals["0"].abs().max()) < 1e-3



def test_momentum_correction_reads_the_parameters_one_by_one_as_it_reads_them_flat():
    """The engine hands the memory its bucket's parameters one by one (no flat copy per step); weight
    decay must add them exactly as it adds the flat concatenation: the same velocity and residual bits.
    (Without clipping, which is per parameter: test_local_clipping_is_per_parameter_whatever_the_bucket.)"""
    shapes = [(37, 3), (37,), (1001,), (16, 8, 3, 3)]
    generator = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=generator) for s in shapes]
    flat_params = torch.cat([p.reshape(-1) for p in params])
    one_by_one, flat = (MomentumCorrection(0.9, None, 2, weight_decay=5e-4, masking=False) for _ in range(2))
    for _ in range(3):
        grad = torch.randn(flat_params.numel(), generator=generator)
        assert torch.equal(one_by_one.compensate(grad, "0", params), flat.compensate(grad, "0", flat_params))
        one_by_one.update(grad, "0", grad / 3)
        flat.update(grad, "0", grad / 3)
    assert torch.equal(one_by_one.velocities["0"], flat.velocities["0"])
    with pytest.raises(ValueError, match="parameters hold"):
        one_by_one.compensate(torch.zeros(5), "1", params)
