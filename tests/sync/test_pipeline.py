"""The compression pipeline: warm-up, error feedback and replay, one object that the exchanges compose."""
import pytest
import torch

from convoy.compress import FP16Compressor, LayerInfo, TopKCompressor, build_compressor
from convoy.ddp import CompressedHookState
from convoy.ps.push import RowCodec
from convoy.sync import AllReduce, CompressionPipeline
from convoy.sync.pipeline import WARMUP_START_DENSITY


def test_the_warm_up_ramps_a_density_and_sends_a_density_less_compressor_dense():
    sparse = CompressionPipeline(*build_compressor("topk", element_fraction=0.01), warmup_steps=10)
    densities = [sparse.warmup_density(step) for step in range(12)]
    assert densities[0] == WARMUP_START_DENSITY and densities[10:] == [None, None]
    assert all(a > b for a, b in zip(densities[:10], densities[1:10]))
    assert all(sparse.compressor_at(step) is sparse.compressor for step in range(12))
    half = CompressionPipeline(FP16Compressor(), warmup_steps=3)
    assert [half.compressor_at(step) is half.compressor for step in range(5)] == [False] * 3 + [True] * 2
    assert all(half.warmup_density(step) is None for step in range(5))


def test_error_feedback_conserves_the_gradient_over_steps():
    """What was sent over the steps plus the residual left is the sum of the gradients, to rounding."""
    pipeline = CompressionPipeline(*build_compressor("topk", element_fraction=0.05))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(400, generator=g) for _ in range(6)]
    sent = torch.zeros(400)
    for step, grad in enumerate(grads):
        compressor = pipeline.compressor_at(step)
        compensated = pipeline.compensate(grad.clone(), "0")
        payload, ctx = compressor.compress(compensated, "0", LayerInfo(step=step))
        pipeline.keep_unsent(compensated, "0", compressor, payload, ctx)
        sent += compressor.decompress(payload, ctx)
    residual = pipeline.state_tensors()["residual.0"]
    torch.testing.assert_close(sent + residual, torch.stack(grads).sum(0), rtol=0, atol=1e-5)


def test_a_replay_hands_out_logged_averages_only_while_it_runs():
    pipeline = CompressionPipeline()
    logged = torch.arange(3.0)
    pipeline.start_replay(lambda step, layers: logged if step < 2 else None)
    assert pipeline.replaying and pipeline.replayed(1, ("fc",)) is logged
    assert pipeline.replayed(1, None) is None and pipeline.replayed(2, ("fc",)) is None
    pipeline.stop_replay()
    assert not pipeline.replaying and pipeline.replayed(1, ("fc",)) is None


def test_the_exchanges_compose_the_pipeline_they_are_given():
    pipeline = CompressionPipeline(TopKCompressor(0.1), warmup_steps=4)
    assert AllReduce(None, pipeline=pipeline).pipeline is pipeline
    assert RowCodec(pipeline).pipeline is pipeline
    state = CompressedHookState(*build_compressor("topk", element_fraction=0.1), warmup_steps=4)
    assert state.exchange.pipeline is state.pipeline and state.exchange.warmup_steps == 4
    with pytest.raises(ValueError, match="not both"):
        AllReduce(None, TopKCompressor(0.1), pipeline=pipeline)
    with pytest.raises(ValueError, match="warmup_steps"):
        CompressionPipeline(warmup_steps=-1)
