"""PowerSGD: each layer's gradient matrix crosses the network as two thin factors.

A parameter's gradient, viewed as an ``n x m`` matrix ``M`` (rows: its first
dimension), is approximated as ``P Q^T`` with ``P`` of ``n x r`` and ``Q`` of
``m x r`` by one step of power iteration per training step. The factors are
what every rank all-reduces, so traffic is ``r (n + m)`` values instead of
``n m`` and does not grow with the number of workers.

One exchange takes two rounds, and every rank follows the same steps:

1. ``P_i = M_i Q`` with the ``Q`` every rank shares (warm start: last step's).
2. All-reduce: ``P = sum_i P_i = (sum_i M_i) Q``, a power-iteration step on
   the sum of the gradients (because ``Q`` is the same on every rank).
3. Orthogonalise ``P``'s columns (Gram-Schmidt); every rank gets the same ``P^``.
4. ``Q_i = M_i^T P^``; the rank's own contribution is ``P^ Q_i^T``, the
   projection of ``M_i`` onto ``P^``'s columns. Its error-feedback residual
   is ``M_i - P^ Q_i^T``: exactly what this rank did not send.
5. All-reduce: ``Q = sum_i Q_i``; the summed update is ``P^ Q^T``, which is the
   sum of the ranks' contributions. ``Q`` is kept as the next step's warm start.

A parameter server cannot run step 5: its workers push their own ``Q_i``.
Asked for a remote payload (``LayerInfo.remote``), the final payload also
carries the ``P^`` every worker agreed on, so the server decodes each row as
``P^ Q_i^T`` and sums: the same ``P^ (sum_i Q_i)^T``. The workers then sum
their ``Q_i`` among themselves for the warm start (:meth:`keep_sum`).

Parameters whose factors would not be at least ``min_compression`` times
smaller than the matrix (biases, small layers, a rank as large as the matrix's
smaller side) are sent dense, in the second round.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convoy.compress.base import Compressor, LayerInfo, Memory, Payload, ResidualMemory, Support
from convoy.compress.registry import CompressorSpec, register


# Columns of the factors unless told otherwise: rank 2 ended further below dense on vgg_fc than 4
# (docs/compression.md).
DEFAULT_RANK = 4


@dataclass(frozen=True)
class _Segment:
    """One parameter of a flat gradient: where it lies, and its matrix shape when sent as factors."""

    offset: int
    numel: int
    rows: int = 0   # 0: sent dense
    cols: int = 0

    @property
    def low_rank(self) -> bool:
        return self.rows > 0


@dataclass
class _Exchange:
    """What one layer's exchange carries from round to round."""

    name: str
    segments: tuple[_Segment, ...]
    flat: torch.Tensor                                             # the compensated gradient
    matrices: list[torch.Tensor] = field(default_factory=list)   # the compensated gradient's matrices
    bases: list[torch.Tensor] = field(default_factory=list)      # orthonormal P of each, after round 1
    round: int = 1
    remote: bool = False   # the final payload carries the bases (a receiver without the rounds decodes it)

    def final_round(self, bases: list[torch.Tensor]) -> None:
        """Round 1 is over: ``bases`` are the orthonormal P of the matrices (none without matrices)."""
        self.bases, self.round = bases, 2


def times_thin(matrix: torch.Tensor, thin: torch.Tensor) -> torch.Tensor:
    """``matrix @ thin`` for a ``thin`` of few columns (the rank), computed as ``(thin^T matrix^T)^T``.

    The same products, summed in another order (the last bits differ from
    ``matrix @ thin``; every rank computes alike). CPU GEMM streams the large
    matrix several times faster with the thin factor on the left than on the
    right, for ``M Q`` and more for ``M^T P`` (measured in docs/compression.md).
    Returns a transposed view; ``reshape(-1)`` lays it out row by row, as
    ``matrix @ thin`` would be.

    Example::

        >>> torch.testing.assert_close(times_thin(m, q), m @ q)
    """
    return (thin.T @ matrix.T).T


def orthonormalise(matrix: torch.Tensor, eps: float = 1e-8, rel_tol: float = 1e-5) -> torch.Tensor:
    """Gram-Schmidt on ``matrix``'s columns, in place; returns it.

    A column (nearly) in the span of the ones before it is zeroed instead of
    normalised: what is left of it after the projection is rounding error
    (below ``rel_tol`` of its length before), and scaling that up to unit
    length would add an arbitrary direction whose size depends on the CPU's
    rounding. Zero columns carry nothing, and no NaN reaches the factors.
    """
    for i in range(matrix.shape[1]):
        column = matrix[:, i]
        if i:
            before = matrix[:, :i]
            length = torch.linalg.vector_norm(column)
            column.sub_(before @ (before.T @ column))
            column.mul_(_column_scale(torch.linalg.vector_norm(column), length, eps, rel_tol))
        else:
            column.div_(torch.linalg.vector_norm(column).clamp_min(eps))
    return matrix


# numpy scalars of the tensor types that have one: they round as the tensors' 0-dim operations do.
_SCALAR_TYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _column_scale(left: torch.Tensor, length: torch.Tensor, eps: float, rel_tol: float) -> float | torch.Tensor:
    """``1 / left``, or 0 where only rounding error is left (``left <= length * rel_tol + eps``).

    On scalars of the columns' own type where numpy has one: each operation rounds as on the
    0-dim tensors (``rel_tol`` and ``eps`` taken in that type first, as a tensor operation takes
    a Python number), so the scale has the same bits, without five small tensor operations per
    column (a few microseconds each, for every column of every layer, every step).
    """
    kind = _SCALAR_TYPES.get(left.dtype)
    if kind is None:
        return torch.where(left > length * rel_tol + eps, 1 / left.clamp_min(eps), 0.0)
    left_, length_, eps_ = kind(left.item()), kind(length.item()), kind(eps)
    return float(kind(1) / np.maximum(left_, eps_)) if left_ > length_ * kind(rel_tol) + eps_ else 0.0


class PowerSGDCompressor(Compressor):
    """Rank-``r`` factors of each layer's gradient matrices, found by warm-started power iteration.

    Use it with an exchange that runs :meth:`Compressor.next_round` (convoy's
    :class:`~convoy.sync.AllReduce` and the strategies built on it) and with
    error feedback (:class:`~convoy.compress.ResidualMemory`, or
    :class:`~convoy.compress.MomentumCorrection` without masking under SGD
    with momentum). Decompressing the summed final payload stores its ``Q``
    as the next step's warm start; exchanges decompress the summed payload
    after the local one, so the shared ``Q`` is what remains.

    Args:
        rank: ``r``, columns of the factors. A parameter whose matrix has a
            side of ``r`` or fewer is sent dense.
        min_compression: send factors only where they are at least this many
            times smaller than the matrix; the rest goes dense.
        seed: seeds the first ``Q`` of each parameter (the same on every rank).

    Example::

        >>> c = PowerSGDCompressor(rank=2)
        >>> payload, ctx = c.compress(grad, "3", LayerInfo(shapes=(w.shape, b.shape)))
        >>> while c.more_rounds(ctx):
        ...     payload, ctx = c.next_round(all_reduced(payload), ctx)
    """

    summable = True
    keeps_sum = True
    # The payloads are new tensors (torch.cat, clone) and the decompression reads only the
    # factors, so the residual may be written over the compensated gradient (unsent's addmm
    # then reads each value before it writes it: the same bits as into another tensor).
    residual_in_place = True

    def __init__(self, rank: int = DEFAULT_RANK, min_compression: float = 2.0, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if not min_compression >= 1.0:
            raise ValueError(f"min_compression must be >= 1, got {min_compression}")
        self.rank, self.min_compression, self.seed = rank, min_compression, seed
        self.warm: dict[str, torch.Tensor] = {}   # "<layer>.<parameter>" -> shared Q (cols x rank)
        self._plans: dict[tuple, tuple[_Segment, ...]] = {}

    # ------------------------------------------------------------- the layout
    def segments(self, tensor: torch.Tensor, info: LayerInfo | None) -> tuple[_Segment, ...]:
        """How ``tensor``'s parameters are sent: as factors (rows, cols) or dense."""
        shapes = tuple(tuple(s) for s in info.shapes) if info and info.shapes else ((tensor.numel(),),)
        plan = self._plans.get(shapes)
        if plan is None:
            plan = self._plans[shapes] = tuple(self._plan(shapes))
        if sum(s.numel for s in plan) != tensor.numel():
            raise ValueError(f"shapes {shapes} do not hold the gradient's {tensor.numel()} values")
        return plan

    def _plan(self, shapes: tuple[tuple[int, ...], ...]) -> list[_Segment]:
        segments, offset = [], 0
        for shape in shapes:
            numel = 1
            for size in shape:
                numel *= size
            rows = shape[0] if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            factored = rows and self.rank < min(rows, cols) and \
                self.rank * (rows + cols) * self.min_compression <= numel
            segments.append(_Segment(offset, numel, rows, cols) if factored else _Segment(offset, numel))
            offset += numel
        return segments

    # ---------------------------------------------------------------- rounds
    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        segments = self.segments(tensor, info)
        flat = tensor.reshape(-1)
        matrices = [flat[s.offset:s.offset + s.numel].view(s.rows, s.cols) for s in segments if s.low_rank]
        ctx = _Exchange(name, segments, flat, matrices, remote=bool(info and info.remote))
        if not ctx.matrices:
            ctx.final_round([])
            return self._final_payload(ctx)
        # 1. P_i = M_i Q, with the Q every rank shares.
        products = [times_thin(m, self._shared_q(name, i, m)) for i, m in enumerate(ctx.matrices)]
        return [torch.cat([p.reshape(-1) for p in products])], ctx

    def more_rounds(self, ctx: Any) -> bool:
        return ctx.round == 1

    def next_round(self, summed: Payload, ctx: Any) -> tuple[Payload, Any]:
        # 2. ``summed`` holds sum_i P_i; 3. orthonormalise each P.
        sizes = [m.shape[0] * self.rank for m in ctx.matrices]
        ctx.final_round([orthonormalise(p.reshape(m.shape[0], self.rank).clone())
                         for p, m in zip(summed[0].split(sizes), ctx.matrices)])
        return self._final_payload(ctx)

    @staticmethod
    def _final_payload(ctx: _Exchange) -> tuple[Payload, Any]:
        """4. ``Q_i = M_i^T P^`` for factored parameters, the values of the dense ones."""
        parts, factored = [], iter(zip(ctx.matrices, ctx.bases))
        for segment in ctx.segments:
            if segment.low_rank:
                matrix, basis = next(factored)
                parts.append(times_thin(matrix.T, basis).reshape(-1))
            else:
                parts.append(ctx.flat[segment.offset:segment.offset + segment.numel])
        # A fresh tensor: the exchange sums it in place, the gradient must stay.
        payload = [torch.cat(parts) if len(parts) > 1 else parts[0].clone()]
        if ctx.remote and ctx.bases:
            payload.append(torch.cat([basis.reshape(-1) for basis in ctx.bases]))
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self._decompress(payload, ctx, None)

    def decompress_mean_into(self, payloads: list[Payload], ctx: Any, out: torch.Tensor,
                             count: int) -> tuple[torch.Tensor, Support | None]:
        if len(payloads) != 1:   # summable: an exchange sums the payloads, it never hands over several
            return super().decompress_mean_into(payloads, ctx, out, count)
        return self._decompress(payloads[0], ctx, out, count), None

    def _decompress(self, payload: Payload, ctx: Any, out: torch.Tensor | None, count: int = 1) -> torch.Tensor:
        # 5. The update is P^ Q^T per factored parameter; keep Q as the next warm start
        # (a remote payload is one worker's Q_i: the workers keep their sum, keep_sum).
        # Every value of ``out`` is written; nothing here reads ctx.flat, which ``out`` may be.
        # A mean (``count`` > 1) divides the summed wire, Q and the dense values, before the
        # product: P^ (Q / count)^T is written once, with no pass dividing the product (for a
        # power-of-two count the same bits as dividing the product; otherwise Q / count is rounded
        # before the product instead of the product after it).
        summed = payload[0]
        wire = summed if count == 1 else summed / count
        if out is None:
            out = torch.empty(ctx.flat.numel(), dtype=ctx.flat.dtype, device=ctx.flat.device)
        elif out.shape != (ctx.flat.numel(),) or out.dtype != ctx.flat.dtype:
            raise ValueError(f"out must be a flat {ctx.flat.dtype} tensor of {ctx.flat.numel()} values, "
                             f"got {out.dtype} {tuple(out.shape)}")
        position, bases = 0, iter(self._bases(payload, ctx))
        for segment in ctx.segments:
            target = out[segment.offset:segment.offset + segment.numel]
            if segment.low_rank:
                q = wire[position:position + segment.cols * self.rank].view(segment.cols, self.rank)
                torch.matmul(next(bases), q.T, out=target.view(segment.rows, segment.cols))
                position += segment.cols * self.rank
            else:
                target.copy_(wire[position:position + segment.numel])
                position += segment.numel
        if not ctx.remote:
            self.keep_sum(payload, ctx)   # the sum, not the mean: the warm start is Q itself
        return out

    def unsent(self, compensated: torch.Tensor, payload: Payload, ctx: Any,
               out: torch.Tensor | None = None) -> torch.Tensor:
        # The residual M_i - P^ Q_i^T in one pass per factored parameter: addmm subtracts each
        # product as it is computed (alpha -1 is exact, and the product is summed and rounded
        # as matmul does it, so the difference is the same as subtracting the decompressed
        # payload), without a decompressed tensor. Dense values: what was sent is themselves.
        wire, flat = payload[0], compensated.reshape(-1)
        out = torch.empty_like(flat) if out is None else out.reshape(-1)
        position, bases = 0, iter(self._bases(payload, ctx))
        for segment in ctx.segments:
            end = segment.offset + segment.numel
            if segment.low_rank:
                q = wire[position:position + segment.cols * self.rank].view(segment.cols, self.rank)
                shape = (segment.rows, segment.cols)
                into, basis = out[segment.offset:end].view(shape), next(bases)
                if self.rank == 1:
                    # At rank 1 addmm may fuse each multiply with the subtraction (one rounding; MKL on
                    # an AVX-512 Xeon does), where matmul rounds the product: subtract matmul's product.
                    torch.sub(flat[segment.offset:end].view(shape), torch.matmul(basis, q.T), out=into)
                else:
                    torch.addmm(flat[segment.offset:end].view(shape), basis, q.T, alpha=-1, out=into)
                position += segment.cols * self.rank
            else:
                torch.sub(flat[segment.offset:end], wire[position:position + segment.numel],
                          out=out[segment.offset:end])
                position += segment.numel
        return out.view_as(compensated)

    def certainly_finite(self, summed: Payload, ctx: Any) -> bool:
        # A decoded value is a dense value of the wire, or sum_k P^_ik Q_jk over the r columns (Q
        # divided by the ranks, which only shrinks it): at most r * max|P^| * max|Q| in magnitude, and
        # so is every partial sum. Where that bound is finite with room for rounding, so is the mean.
        # One read of the maxima back from the device for all of them (each read waits for the device).
        wire, bases = summed[0], self._bases(summed, ctx)
        if wire.numel() == 0:
            return False
        maxima = torch.stack([t.abs().amax() for t in (wire, *bases)]).tolist()
        if not all(math.isfinite(m) for m in maxima):   # checked first: max() skips a NaN after a number
            return False
        largest = maxima[0] * max([1.0] + [self.rank * m for m in maxima[1:]])
        return largest <= torch.finfo(wire.dtype).max / 2

    def keep_sum(self, summed: Payload, ctx: Any) -> None:
        """Keep each factored parameter's ``Q`` of ``summed`` (the final payload summed over the ranks)."""
        position, index = 0, 0
        for segment in ctx.segments:
            if segment.low_rank:
                q = summed[0][position:position + segment.cols * self.rank].view(segment.cols, self.rank)
                self.warm[f"{ctx.name}.{index}"] = q.clone()
                position, index = position + segment.cols * self.rank, index + 1
            else:
                position += segment.numel

    def _bases(self, payload: Payload, ctx: _Exchange) -> list[torch.Tensor]:
        """The orthonormal P of each factored parameter: the rounds', or a remote payload's own."""
        if not ctx.remote:
            return ctx.bases
        rows = [s.rows for s in ctx.segments if s.low_rank]
        if not rows:
            return []
        return [p.view(n, self.rank) for p, n in zip(payload[1].split([n * self.rank for n in rows]), rows)]

    def _shared_q(self, name: str, index: int, matrix: torch.Tensor) -> torch.Tensor:
        key = f"{name}.{index}"
        q = self.warm.get(key)
        if q is None or q.shape != (matrix.shape[1], self.rank):
            # The same seed on every rank gives every rank the same first Q.
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
            q = torch.randn(matrix.shape[1], self.rank, generator=generator, dtype=matrix.dtype).to(matrix.device)
        return q

    # ----------------------------------------------------------- checkpoints
    def forget(self, name: str) -> None:
        for key in [key for key in self.warm if key.rsplit(".", 1)[0] == name]:
            del self.warm[key]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"powersgd_q.{key}": q for key, q in self.warm.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            kind, name = key.split(".", 1)
            if kind == "powersgd_q":
                self.warm[name] = tensor.clone()

    def state_bytes_bound(self, params_bytes: int) -> int:
        # Q of a factored parameter is at most half its size (min_compression >= 1, two factors).
        return params_bytes

    def payload_values(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
        """Values on the wire per exchange of a layer of ``shapes``: (round 1, round 2)."""
        plan = self._plan(tuple(tuple(s) for s in shapes))
        first = sum(s.rows * self.rank for s in plan if s.low_rank)
        return first, sum(s.cols * self.rank if s.low_rank else s.numel for s in plan)


def _build(powersgd_rank: int = DEFAULT_RANK) -> tuple[Compressor, Memory]:
    return PowerSGDCompressor(powersgd_rank), ResidualMemory()


register(CompressorSpec("powersgd", _build, options=("powersgd_rank",), momentum_corrected=True,
                        hook_options={"rank": "powersgd_rank"}))
