"""Random-k sparsification with a seed shared by all ranks, so payloads all-reduce."""
from __future__ import annotations

import zlib
from typing import Any

import torch

from convoy.compress.base import Compressor, LayerInfo, Memory, Payload, ResidualMemory
from convoy.compress.registry import CompressorSpec, register
from convoy.compress.topk import DEFAULT_ELEMENT_FRACTION, kept_count, ramped


class RandomKCompressor(Compressor):
    """Send a random ``fraction`` of a layer's elements, the same ones on every rank.

    The indices come from a generator seeded by the layer's name and the
    step (``info.step``, else how many times that layer was compressed), which
    every rank agrees on; only the values travel, and they can be summed.
    Pair it with :class:`ResidualMemory`.

    Args:
        fraction: share of each layer's elements sent, in (0, 1].
        seed: mixed into every draw.

    Example::

        >>> c = RandomKCompressor(0.01)
        >>> sparse = c.decompress(*c.compress(grad, "3"))
    """

    summable = True
    local = True   # the selection is seeded by the step: every rank draws it alone

    def __init__(self, fraction: float = DEFAULT_ELEMENT_FRACTION, seed: int = 0):
        kept_count(1, fraction)
        self.fraction, self.seed = fraction, seed
        self.density = fraction
        self._calls: dict[str, int] = {}

    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        call = self._calls.get(name, 0) if info is None or info.step is None else info.step
        self._calls[name] = call + 1
        # crc32, not hash(): Python salts str hashes per process.
        generator = torch.Generator().manual_seed((zlib.crc32(name.encode()) << 20) ^ (self.seed << 40) ^ call)
        count = kept_count(flat.numel(), ramped(self.fraction, info))
        indices = torch.randperm(flat.numel(), generator=generator)[:count].to(flat.device)
        return [flat[indices]], (indices, flat.numel())

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        indices, numel = ctx
        return payload[0].new_zeros(numel).index_put_((indices,), payload[0])


def _build(element_fraction: float = DEFAULT_ELEMENT_FRACTION) -> tuple[Compressor, Memory]:
    return RandomKCompressor(element_fraction), ResidualMemory()


# Not offered as a DDP communication hook (convoy.ddp never offered it).
register(CompressorSpec("randomk", _build, options=("element_fraction",), sparse=True, momentum_corrected=True))
