"""PowerSGD inside convoy's engine: exactness, error feedback, two-round exchange, resume, bad flags."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.compress import LayerInfo, MomentumCorrection, PowerSGDCompressor, ResidualMemory
from convoy.compress.powersgd import _column_scale, orthonormalise
from convoy.engine import Engine
from convoy.errors import TrainingDiverged
from convoy.sync import AllReduce
from tests.compress.helpers import one_layer_bucket, small_mlp, train_steps
from tests.helpers import convoy_in_process, one_line_error, run_workers

SHAPES = (torch.Size([24, 3, 2, 2]), torch.Size([24]))   # a conv layer: a 24 x 12 matrix and a bias


def _low_rank_gradient(rank: int, seed: int, left: torch.Tensor | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(24, rank, generator=generator) if left is None else left
    matrix = left @ torch.randn(rank, 12, generator=generator)
    return torch.cat([matrix.reshape(-1), torch.randn(24, generator=generator)])


def _exchange_locally(compressor: PowerSGDCompressor, gradient: torch.Tensor) -> torch.Tensor:
    payload, ctx = compressor.compress(gradient, "0", LayerInfo(shapes=SHAPES))
    while compressor.more_rounds(ctx):
        payload, ctx = compressor.next_round(payload, ctx)
    return compressor.decompress(payload, ctx)


def test_forget_drops_that_layers_warm_start_only():
    compressor = PowerSGDCompressor(2)
    for name in ("1", "10"):
        payload, ctx = compressor.compress(_low_rank_gradient(2, seed=1), name, LayerInfo(shapes=SHAPES))
        payload, ctx = compressor.next_round(payload, ctx)
        compressor.decompress(payload, ctx)
    kept = compressor.state_tensors()
    compressor.forget("1")
    assert set(kept) == {"powersgd_q.1.0", "powersgd_q.10.0"} and set(compressor.state_tensors()) == {"powersgd_q.10.0"}


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_a_gradient_of_rank_r_comes_back_whole_at_rank_r(rank):
    compressor = PowerSGDCompressor(rank)
    gradient = _low_rank_gradient(rank, seed=rank)
    out = _exchange_locally(compressor, gradient)
    torch.testing.assert_close(out, gradient, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[-24:], gradient[-24:])       # the bias goes dense, bit for bit
    # A rank-(r+1) gradient does not: the compressor really is low rank.
    assert not torch.allclose(_exchange_locally(PowerSGDCompressor(rank), _low_rank_gradient(rank + 1, 9)),
                              _low_rank_gradient(rank + 1, 9), atol=1e-3)


def test_factors_are_a_fraction_of_the_matrix_and_a_rank_too_large_sends_it_dense():
    assert PowerSGDCompressor(2).payload_values(SHAPES) == (24 * 2, 12 * 2 + 24)
    # rank 6: factors 6 * (24 + 12) = 216 values, not 2x smaller than 288: dense.
    assert PowerSGDCompressor(6).payload_values(SHAPES) == (0, 24 * 12 + 24)
    assert PowerSGDCompressor(12).payload_values(SHAPES) == (0, 24 * 12 + 24)
    gradient = torch.randn(24 * 12 + 24)
    assert torch.equal(_exchange_locally(PowerSGDCompressor(12), gradient), gradient)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("shapes", [SHAPES, (torch.Size([1024, 2048]), torch.Size([1024])),
                                    (torch.Size([64, 32, 3, 3]), torch.Size([64]), torch.Size([10, 64]))])
def test_the_fused_residual_is_the_gradient_minus_the_decompressed_payload_bit_for_bit(shapes, rank):
    """``unsent`` subtracts each P^ Q_i^T as addmm computes it; the error-feedback residual must be the
    same bits as subtracting the decompressed payload (what convoy did before, and the invariant
    sent + residual == compensated that error feedback rests on)."""
    compressor = PowerSGDCompressor(rank)
    gradient = torch.randn(sum(s.numel() for s in shapes), generator=torch.Generator().manual_seed(rank))
    bias = shapes[0].numel()   # the bias is sent dense: what was sent is its own values, inf and nan too
    gradient[bias:bias + 7] = torch.tensor([float("inf"), -0.0, 0.0, 1e-40, -1e38, 3.0, float("nan")])
    for remote in (False, True):
        payload, ctx = compressor.compress(gradient, "0", LayerInfo(shapes=shapes, remote=remote))
        while compressor.more_rounds(ctx):
            payload, ctx = compressor.next_round(payload, ctx)
        expected = gradient - compressor.decompress(payload, ctx)
        assert float(expected[:bias].abs().max()) > 0.1   # the matrix's residual is not trivially zero
        assert torch.equal(compressor.unsent(gradient, payload, ctx).isnan(), expected.isnan())
        assert torch.equal(compressor.unsent(gradient, payload, ctx).nan_to_num(), expected.nan_to_num())
        placed = torch.empty_like(gradient)
        assert compressor.unsent(gradient, payload, ctx, out=placed).data_ptr() == placed.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_columns_scale_computed_on_scalars_has_the_bits_of_the_tensor_formula(dtype):
    """orthonormalise scales each column with numpy scalars of its type instead of 0-dim tensors; the
    column must come out with the same bits as under the tensor formula, rounding error and edges alike."""
    values = [0.0, 1e-45, 1e-9, 1e-8, 1.00000001e-8, 1e-7, 0.3, 1.0, 3e5, 1e30, 3e38, float("inf"), float("nan")]
    values += torch.rand(30, generator=torch.Generator().manual_seed(0)).pow(20).tolist()
    column = torch.randn(37, dtype=dtype, generator=torch.Generator().manual_seed(1))
    for left, length in itertools.product(values, values):
        left_t, length_t = torch.tensor(left, dtype=dtype), torch.tensor(length, dtype=dtype)
        expected = torch.where(left_t > length_t * 1e-5 + 1e-8, 1 / left_t.clamp_min(1e-8), 0.0)
        got = column.clone().mul_(_column_scale(left_t, length_t, 1e-8, 1e-5))
        torch.testing.assert_close(got, column.clone().mul_(expected), rtol=0, atol=0, equal_nan=True,
                                   msg=f"left {left}, length {length}")


def test_orthonormalisation_of_a_rank_deficient_p_gives_no_nan():
    p = torch.zeros(10, 3)
    p[:, 0] = torch.arange(10.0)
    p[:, 1] = 2 * p[:, 0]                      # in the span of the first column
    basis = orthonormalise(p.clone())
    assert torch.isfinite(basis).all()
    assert float(basis[:, 0].norm()) == pytest.approx(1.0)
    assert float(basis[:, 1:].norm()) < 1e-3


def test_momentum_sgd_exactly_when_every_layer_is_too_small_to_factor():
    dense, corrected = small_mlp(), small_mlp()
    train_steps(dense, torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4), 8)
    memory = MomentumCorrection(0.9, weight_decay=5e-4, masking=False)
    engine = Engine(corrected, torch.optim.SGD, AllReduce(None, PowerSGDCompressor(32), memory), lr=0.1)
    train_steps(corrected, engine, 8)
    engine.close()
    for a, b in zip(dense.parameters(), corrected.parameters()):
        assert torch.equal(a, b)


def _conservation_worker(rank: int, world: int) -> dict:
    """Steps of two-rank PowerSGD with momentum correction: per step the averages, the velocities, the residual."""
    torch.manual_seed(rank)
    memory = MomentumCorrection(0.9, masking=False)
    strategy = AllReduce(dist.new_group(), PowerSGDCompressor(2), memory)
    bucket = one_layer_bucket((24, 3, 2, 2), (24,))
    applied, velocity, velocities = torch.zeros(312), torch.zeros(312), torch.zeros(312)
    for _ in range(10):
        gradient = torch.randn(312)
        bucket.flat_grad().copy_(gradient)
        residual_before = memory.residuals.get("0", torch.zeros(312)).clone()
        compensated = residual_before + 0.9 * velocity + gradient
        average = strategy.start(bucket, bucket.flat_grad()).wait()
        velocity = 0.9 * velocity + gradient
        # This rank's contribution is exactly what left its memory.
        sent = compensated - memory.residuals["0"]
        assert torch.equal(memory.velocities["0"], velocity)
        applied += average
        velocities += velocity
    return {"applied": applied, "velocities": velocities, "residual": memory.residuals["0"],
            "sent_bytes": strategy.traffic()[0], "last_sent": sent, "last_average": average}


@pytest.mark.timeout(120)
def test_error_feedback_with_momentum_correction_conserves_the_velocities_over_two_ranks():
    """Over the steps, world x (sum of averages applied) + the ranks' residuals == the ranks' summed velocities."""
    results = run_workers(_conservation_worker, 2)
    world = len(results)
    applied = results[0]["applied"]
    assert all(torch.equal(r["applied"], applied) for r in results)          # every rank applies the same
    velocities = sum(r["velocities"] for r in results)
    residuals = sum(r["residual"] for r in results)
    torch.testing.assert_close(world * applied + residuals, velocities, rtol=1e-5, atol=1e-5)
    # The average is the mean of the ranks' contributions (sum of per-rank products P^ Q_i^T).
    torch.testing.assert_close(results[0]["last_average"], sum(r["last_sent"] for r in results) / world,
                               rtol=1e-5, atol=1e-6)
    assert float(residuals.norm()) > 0.1                     # something was really held back
    # Two rounds of factors (P: 24 x 2, Q + bias: 12 x 2 + 24) per step, not 312 values.
    assert results[0]["sent_bytes"] == 10 * (48 * 4 + 48 * 4)   # a ring of two sends each payload once


def _shared_basis_worker(rank: int, world: int) -> torch.Tensor:
    left = torch.randn(24, 2, generator=torch.Generator().manual_seed(0))   # the same column space
    strategy = AllReduce(dist.new_group(), PowerSGDCompressor(2), ResidualMemory())
    bucket = one_layer_bucket((24, 3, 2, 2), (24,))
    bucket.flat_grad().copy_(_low_rank_gradient(2, seed=10 + rank, left=left))
    return strategy.start(bucket, bucket.flat_grad()).wait()


@pytest.mark.timeout(120)
def test_the_average_of_rank_r_gradients_sharing_a_column_space_is_exact():
    results = run_workers(_shared_basis_worker, 2)
    left = torch.randn(24, 2, generator=torch.Generator().manual_seed(0))
    expected = sum(_low_rank_gradient(2, seed=10 + r, left=left) for r in range(2)) / 2
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-5)


def _deferred_rounds_worker(rank: int, world: int, defer: bool) -> dict:
    """Five engine steps of a three-layer model, one layer per bucket, with P all-reduced blocking in
    start or left in flight until the engine advances the exchange."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    strategy = AllReduce(dist.new_group(), PowerSGDCompressor(2), MomentumCorrection(0.9, masking=False))
    strategy.defers_rounds = defer
    engine = Engine(model, torch.optim.SGD, strategy, lr=0.1, bucket_bytes=0)
    train_steps(model, engine, 5, seed=rank)
    engine.close()
    # Left in flight: the exchange is not done, however long it waits, until advanced.
    probe = AllReduce(dist.new_group(), PowerSGDCompressor(2), ResidualMemory())
    probe.defers_rounds = defer
    bucket = one_layer_bucket((24, 3, 2, 2), (24,))
    bucket.flat_grad().copy_(_low_rank_gradient(2, seed=rank))
    pending = probe.start(bucket, bucket.flat_grad())
    dist.barrier()
    in_flight = not pending.is_done()
    pending.advance()
    return {"params": [p.detach().clone() for p in model.parameters()], "in_flight": in_flight,
            "average": pending.wait(), "sent": strategy.traffic()[0]}


@pytest.mark.timeout(120)
def test_deferring_the_p_round_to_the_next_bucket_changes_no_bit():
    """The engine starts the next bucket before taking the previous one's P sum (order P0 P1 Q0 P2 Q1 ...
    on every rank); the parameters, the average and the bytes are those of the blocking rounds."""
    deferred, blocking = run_workers(_deferred_rounds_worker, 2, True), run_workers(_deferred_rounds_worker, 2, False)
    for a, b in zip(deferred + [deferred[0]], blocking + [deferred[1]]):   # each rank alike, and the ranks alike
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert torch.equal(a["average"], b["average"]) and a["sent"] == b["sent"]
    assert all(r["in_flight"] for r in deferred)


@settings(max_examples=200, deadline=None)
@given(rank=st.integers(1, 3), seed=st.integers(0, 2**16), exponent=st.integers(-30, 38),
       poison=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]), where=st.integers(0, 311))
def test_powersgd_vouches_for_a_finite_mean_only_where_it_is_finite(rank, seed, exponent, poison, where):
    """The bound on the payload (r max|P^| max|Q|) never vouches for a mean with a NaN or an infinity,
    however large the gradient; and for gradients of ordinary size it does vouch (the scan is skipped)."""
    compressor = PowerSGDCompressor(rank)
    gradient = _low_rank_gradient(3, seed) * 10.0 ** exponent
    if poison is not None:
        gradient[where] = poison
    payload, ctx = compressor.compress(gradient, "0", LayerInfo(shapes=SHAPES))
    payload, ctx = compressor.next_round(payload, ctx)
    vouched = compressor.certainly_finite(payload, ctx)
    mean = compressor.decompress(payload, ctx)
    assert not vouched or bool(torch.isfinite(mean).all())
    assert vouched or poison is not None or exponent > 30


def test_a_nan_in_a_basis_is_not_vouched_for_even_where_the_wire_is_finite():
    compressor = PowerSGDCompressor(2)
    payload, ctx = compressor.compress(_low_rank_gradient(2, seed=3), "0", LayerInfo(shapes=SHAPES))
    payload, ctx = compressor.next_round(payload, ctx)
    assert compressor.certainly_finite(payload, ctx)
    ctx.bases[0][0, 1] = float("nan")   # Python's max(1.0, nan) is 1.0: the bound must not take it so
    assert bool(torch.isfinite(payload[0]).all()) and not compressor.certainly_finite(payload, ctx)


def _finite_worker(rank: int, world: int) -> dict:
    """What a two-rank PowerSGD exchange says of its mean, for a finite gradient and for a NaN on rank 0,
    and whether the engine stops on a NaN loss before the update."""
    probe = AllReduce(dist.new_group(), PowerSGDCompressor(2), ResidualMemory())
    said = {}
    for case, poison in (("finite", None), ("nan", float("nan"))):
        bucket = one_layer_bucket((24, 3, 2, 2), (24,))
        bucket.flat_grad().copy_(_low_rank_gradient(2, seed=rank))
        if poison is not None and rank == 0:
            bucket.flat_grad()[5] = poison
        pending = probe.start(bucket, bucket.flat_grad())
        mean = pending.wait()
        said[case] = (pending.finite, bool(torch.isfinite(mean).all()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
    engine = Engine(model, torch.optim.SGD, AllReduce(dist.new_group(), PowerSGDCompressor(2),
                                                      MomentumCorrection(0.9, masking=False)), lr=0.1)
    train_steps(model, engine, 2, seed=rank)
    before = [p.detach().clone() for p in model.parameters()]
    loss = F.cross_entropy(model(torch.randn(8, 12)), torch.randint(0, 4, (8,)))
    try:
        engine.backward(loss * (float("nan") if rank == 0 else 1.0))
        engine.synchronize()
        said["stopped"] = None
    except TrainingDiverged as error:
        said["stopped"] = str(error)
    said["unchanged"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    engine.close()
    return said


@pytest.mark.timeout(120)
def test_a_nan_on_one_rank_still_stops_every_rank_before_the_update_when_finite_means_skip_the_scan():
    for said in run_workers(_finite_worker, 2):
        assert said["finite"] == (True, True)        # vouched for from the payload: no scan of the mean
        assert said["nan"] == (False, False)         # not vouched for: the engine scans it, and it is NaN
        assert "non-finite" in said["stopped"] and said["unchanged"]


JOB = ("--nproc", "2", "--batch-size", "32", "--lr-schedule", "constant", "--compress", "powersgd",
       "--no-progress", "--eval-every", "0")


def _parameters(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt")["model"]


@pytest.mark.timeout(300)
def test_a_resumed_powersgd_run_is_bit_identical(tmp_path):
    """12 steps straight, and 7 steps then a resume to 12: the warm-start Q, the residuals and the
    velocities travel in the checkpoint, so both runs end with the same bits."""
    whole = convoy_in_process("train", *JOB, "--steps", "12", "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    first = convoy_in_process("train", *JOB, "--steps", "7", "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    second = convoy_in_process("train", *JOB, "--steps", "12", "--checkpoint-dir", str(tmp_path / "ckpt"),
                               "--out", str(tmp_path / "b"))
    assert second.returncode == 0 and "resumed from" in second.stderr, second.stderr
    whole_params, resumed = _parameters(tmp_path / "whole"), _parameters(tmp_path / "b")
    assert whole_params.keys() == resumed.keys()
    for key in whole_params:
        assert torch.equal(whole_params[key], resumed[key]), key


def test_the_strategy_state_holds_q_residuals_and_velocities():
    strategy = AllReduce(None, PowerSGDCompressor(2), MomentumCorrection(0.9, masking=False))
    bucket = one_layer_bucket((24, 3, 2, 2), (24,))
    bucket.flat_grad().copy_(torch.randn(312))
    strategy.start(bucket, bucket.flat_grad()).wait()
    state = strategy.state_tensors()
    assert set(state) == {"residual.0", "velocity.0", "powersgd_q.0.0"}
    assert state["powersgd_q.0.0"].shape == (12, 2)
    fresh = AllReduce(None, PowerSGDCompressor(2), MomentumCorrection(0.9, masking=False))
    fresh.load_state_tensors(state)
    assert all(torch.equal(fresh.state_tensors()[k], v) for k, v in state.items())
    assert strategy.state_bytes_bound(312 * 4) >= sum(t.numel() * 4 for t in state.values())


@pytest.mark.parametrize("value, expected", [("0", "--powersgd-rank must be >= 1"),
                                             ("-2", "--powersgd-rank must be >= 1"),
                                             ("1.5", "--powersgd-rank: invalid int value"),
                                             ("two", "--powersgd-rank: invalid int value")])
def test_a_bad_powersgd_rank_is_one_line_and_exit_2(value, expected):
    assert expected in one_line_error(convoy_in_process("train", "--compress", "powersgd",
                                                         f"--powersgd-rank={value}"))


def test_help_says_a_rank_too_large_sends_the_layer_dense():
    run = convoy_in_process("train", "--help")
    assert "--powersgd-rank" in run.stdout and "sent dense" in " ".join(run.stdout.split())


def test_powersgd_with_sgd_momentum_trains_with_momentum_correction_by_default():
    from convoy.train.config import TrainConfig
    from convoy.train.loop import optimizer_spec

    corrected = TrainConfig.from_flat(compress="powersgd", lr=0.05)
    assert optimizer_spec(corrected)[1] == {"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}
    plain = TrainConfig.from_flat(compress="powersgd", lr=0.05, momentum_correction=False)
    assert optimizer_spec(plain)[1]["momentum"] == 0.9


def _steps(memory, compressor: PowerSGDCompressor, gradients: list[torch.Tensor], info: LayerInfo,
           snapshot_every_step: bool = False) -> list[dict[str, torch.Tensor]]:
    """Error feedback over ``gradients`` in a world of one; each step's kept tensors, by reference."""
    kept = []
    for gradient in gradients:
        compensated = memory.compensate(gradient, "0")
        payload, ctx = compressor.compress(compensated, "0", info)
        while compressor.more_rounds(ctx):
            payload, ctx = compressor.next_round(payload, ctx)
        memory.keep_unsent(compensated, "0", compressor, payload, ctx)
        kept.append(memory.state_tensors() if snapshot_every_step else dict(
            (f"{kind}.{name}", t) for kind, tensors in memory.kept().items() for name, t in tensors.items()))
    return kept


@pytest.mark.parametrize("make_memory", [lambda: MomentumCorrection(0.9, masking=False), ResidualMemory])
def test_error_feedback_reuses_its_buffers_but_never_writes_into_a_snapshot(make_memory):
    info = LayerInfo(shapes=(torch.Size([24, 13]),))
    gradients = [torch.randn(24 * 13, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    reused, lent = make_memory(), make_memory()
    unlent = _steps(reused, PowerSGDCompressor(2), gradients, info)
    # Two buffers per kind (the kept one and the one it replaced): nothing new after the first steps.
    addresses = {t.data_ptr() for step in unlent[2:] for t in step.values()}
    assert len(addresses) == 2 * len(unlent[-1])
    # Handing the state out each step (a checkpoint keeps references) gives the same values, and a
    # snapshot handed out is never written into by the steps after it.
    snapshots = _steps(lent, PowerSGDCompressor(2), gradients, info, snapshot_every_step=True)
    copies = [{k: t.clone() for k, t in s.items()} for s in snapshots]
    _steps(lent, PowerSGDCompressor(2), gradients[:3], info)
    for snapshot, copy in zip(snapshots, copies):
        assert all(torch.equal(snapshot[k], copy[k]) for k in copy)
    assert all(torch.equal(unlent[-1][k], snapshots[-1][k]) for k in copies[-1])


def _three_rank_worker(rank: int, world: int) -> list[torch.Tensor]:
    """Six steps of PowerSGD with momentum correction through the engine, each rank on its own batches."""
    model = small_mlp()
    memory = MomentumCorrection(0.9, clip_norm=1.0, world_size=world, weight_decay=5e-4, masking=False)
    engine = Engine(model, torch.optim.SGD, AllReduce(dist.new_group(), PowerSGDCompressor(2), memory), lr=0.1)
    train_steps(model, engine, 6, seed=10 + rank)
    engine.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_three_ranks_end_with_bit_identical_parameters():
    """A world that is not a power of two: the mean is taken in Q (Q / 3 rounds), alike on every rank."""
    results = run_workers(_three_rank_worker, 3)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    assert not all(torch.equal(a, b) for a, b in zip(results[0], small_mlp().parameters()))   # it trained
