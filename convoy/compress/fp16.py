"""Half-precision payloads: half the bytes, rounding error kept by the memory."""
from __future__ import annotations

from typing import Any

import torch

from convoy.compress.base import Compressor, LayerInfo, Payload


class FP16Compressor(Compressor):
    # fp16 sums can overflow where fp32 would not; gradients of CNNs stay far
    # below 65504, and summing in the wire format is what makes it all-reducible.
    summable = True

    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        return [tensor.to(torch.float16)], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx)
