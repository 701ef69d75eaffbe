"""Element-wise top-k (DGC-style sparsification): the k largest magnitudes and their indices."""
from __future__ import annotations

from typing import Any

import torch

from convoy.compress.base import Compressor, LayerInfo, Memory, Payload, ResidualMemory
from convoy.compress.registry import CompressorSpec, register

# The share of elements topk and randomk send unless told (convoy train's --element-fraction).
DEFAULT_ELEMENT_FRACTION = 0.01


def kept_count(numel: int, fraction: float) -> int:
    """Elements a fraction keeps of ``numel``: rounded, at least one (none of nothing)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return min(numel, max(1, round(fraction * numel)))


def ramped(fraction: float, info: LayerInfo | None) -> float:
    """``fraction``, or the warm-up's higher density when ``info`` carries one."""
    return max(fraction, info.density) if info is not None and info.density is not None else fraction


class TopKCompressor(Compressor):
    """Send the ``fraction`` of a layer's elements with the largest magnitude.

    The payload is the values and their int32 indices; ranks choose different
    indices, so payloads are gathered, not summed. Pair it with
    :class:`ResidualMemory` for error feedback.

    Args:
        fraction: share of each layer's elements sent, in (0, 1].

    Example::

        >>> c = TopKCompressor(0.01)
        >>> sparse = c.decompress(*c.compress(grad, "3"))
    """

    summable = False
    local = True

    def __init__(self, fraction: float = DEFAULT_ELEMENT_FRACTION):
        kept_count(1, fraction)
        self.fraction = self.density = fraction

    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        fraction = ramped(self.fraction, info)
        indices = flat.abs().topk(kept_count(flat.numel(), fraction), sorted=False).indices
        return [flat[indices], indices.to(torch.int32)], (flat.numel(), flat.dtype, fraction)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        values, indices = payload
        numel, dtype, _ = ctx
        return torch.zeros(numel, dtype=dtype, device=values.device).index_put_((indices.long(),), values)

    def decompress_add(self, payload: Payload, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        values, indices = payload
        return out.index_add_(0, indices.long(), values)

    def max_payload_bytes(self, ctx: Any) -> int | None:
        numel, dtype, fraction = ctx
        return kept_count(numel, fraction) * (dtype.itemsize + 4)  # values and int32 indices


def _build(element_fraction: float = DEFAULT_ELEMENT_FRACTION) -> tuple[Compressor, Memory]:
    return TopKCompressor(element_fraction), ResidualMemory()


register(CompressorSpec("topk", _build, options=("element_fraction",), sparse=True, momentum_corrected=True,
                        hook_options={"element_fraction": "element_fraction"}))
