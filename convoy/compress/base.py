"""The compressor interface: compress, decompress, and an error-feedback memory."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

Payload = list[torch.Tensor]


class Compressor(ABC):
    """Turns a layer's flat gradient into the tensors that cross the network.

    ``summable`` says whether payloads from different ranks can be added
    element-wise, which lets a sync strategy all-reduce them; otherwise it must
    gather every rank's payload and decompress each.
    """

    summable: bool = True

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """Return the payload for ``tensor`` and the context decompress needs."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Rebuild a dense tensor from ``payload``."""


class Memory(ABC):
    """What a compressor could not send, kept for the next step (error feedback)."""

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Add what earlier steps left unsent to this step's gradient."""

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        """Remember ``compensated - sent`` as the new residual."""


class NoMemory(Memory):
    """Drop whatever was not sent."""

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        pass


class ResidualMemory(Memory):
    """Error feedback: the unsent part is added to the next step's gradient.

    Invariant: ``sent + new residual == gradient + old residual`` exactly,
    because the residual is computed as that difference.
    """

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        residual = self.residuals.get(name)
        return tensor if residual is None else tensor + residual

    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        self.residuals[name] = compensated - sent
