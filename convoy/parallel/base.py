"""The parallel-layout interface: what this rank trains, on which samples, with whom."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        """Test accuracy and mean loss with the current parameters; a collective over all ranks."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's ``state_dict`` on rank 0, ``None`` elsewhere; a collective."""

    def checkpoint_scope(self) -> tuple[nn.Module, list[int] | None, dict[str, str] | None]:
        """What this rank checkpoints: the module its engine trains, the ranks that
        replicate it (None: every rank), and the whole model's names of its keys
        (None: it is the whole model)."""
        return self.engine.model, None, None

    def checkpoint_engine(self) -> Engine:
        """The engine whose updates a checkpoint snapshots (the one that trains ``checkpoint_scope``'s module)."""
        return self.engine

    def step_metrics(self, step: int) -> dict[str, Any]:
        """Layout-specific figures of ``step`` for the metrics file (none by default)."""
        return {}

    def save_trace(self, run_dir: Path) -> None:
        """Write this rank's timeline (``--trace``: the sync strategy's, if it keeps one) into ``run_dir``."""
        timeline = self.engine.sync.timeline
        if timeline is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            timeline.save(run_dir)
