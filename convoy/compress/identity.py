"""No compression: the gradient itself is the payload."""
from __future__ import annotations

from typing import Any

import torch

from convoy.compress.base import Compressor, LayerInfo, Memory, NoMemory, Payload
from convoy.compress.registry import CompressorSpec, register


class IdentityCompressor(Compressor):
    summable = True

    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]


def _build() -> tuple[Compressor, Memory]:
    return IdentityCompressor(), NoMemory()


register(CompressorSpec("none", _build))
