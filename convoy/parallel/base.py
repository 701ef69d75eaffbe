"""The parallel-layout interface: what this rank trains, on which samples, with whom."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from convoy.engine import Engine


class ParallelLayout(ABC):
    """One rank's share of a training job.

    ``data_rank`` / ``data_world_size`` say which contiguous part of each
    global batch this rank reads; ``engine`` synchronises and updates its layers.
    """

    data_rank: int
    data_world_size: int
    engine: Engine

    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """Run forward and backward on this rank's batch; return (loss, correct predictions)."""

    @abstractmethod
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for ``x`` with the current parameters (call after ``engine.synchronize``)."""
