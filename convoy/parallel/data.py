"""Data parallelism: every rank holds the whole model and a slice of every batch."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.engine import Engine
from convoy.parallel.base import ParallelLayout
from convoy.train.scoring import average_buffers, score

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DataParallel(ParallelLayout):
    """The whole model on every rank; the engine averages gradients over all of them.

    Args:
        model: this rank's replica (identical on every rank).
        engine: the engine that owns ``model``'s parameters.
        rank, world_size: this rank's place among the data-parallel replicas.
        loss_fn: ``(logits, labels) -> scalar loss``, a mean over the batch so
            that averaging over ranks gives the mean over the global batch.
    """

    def __init__(self, model: nn.Module, engine: Engine, rank: int, world_size: int,
                 loss_fn: LossFn = nn.functional.cross_entropy):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.model = model
        self.engine = engine
        self.data_rank = rank
        self.data_world_size = world_size
        self.loss_fn = loss_fn

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        self.model.train()
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        self.engine.backward(loss)
        return loss.item(), int((logits.argmax(1) == y).sum())

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for ``x`` with the current parameters (call after ``engine.synchronize``)."""
        self.model.eval()
        with torch.no_grad():
            return self.model(x)

    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        self.engine.synchronize()
        average_buffers(self.model)
        return score(self.predict, test, device)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.model.state_dict() if rank == 0 else None
