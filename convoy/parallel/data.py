"""Data parallelism: every rank holds the whole model and a slice of every batch."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.engine import Engine
from convoy.engine.gradients import LossScaler
from convoy.parallel.base import ParallelLayout
from convoy.parallel.precision import Precision
from convoy.parallel.scoring import average_buffers, score

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DataParallel(ParallelLayout):
    """The whole model on every rank; the engine averages gradients over all of them.

    Args:
        model: this rank's replica (identical on every rank).
        engine: the engine that owns ``model``'s parameters.
        rank, world_size: this rank's place among the data-parallel replicas.
        loss_fn: ``(logits, labels) -> scalar loss``, a mean over the batch so
            that averaging over ranks gives the mean over the global batch.
        grad_accum: split each batch into this many micro-batches, forward and
            backward one at a time, and exchange the summed gradient once: the
            same step as the whole batch, with a micro-batch's activation memory.
        amp: ``"bf16"`` or ``"fp16"``: run forward and the loss under
            ``torch.autocast`` in that type; ``None`` or ``"off"``: float32.
        scaler: the fp16 loss scaler (the engine's gate unscales with it).
    """

    def __init__(self, model: nn.Module, engine: Engine, rank: int, world_size: int,
                 loss_fn: LossFn = nn.functional.cross_entropy, grad_accum: int = 1,
                 amp: str | None = None, scaler: LossScaler | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.model = model
        self.engine = engine
        self.data_rank = rank
        self.data_world_size = world_size
        self.loss_fn = loss_fn
        self.precision = Precision(grad_accum, amp, scaler)

    @property
    def scaler(self) -> LossScaler | None:
        """The fp16 loss scaler the step multiplies the loss by (the engine's gate unscales with the same)."""
        return self.precision.scaler

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        return self.precision.train_step(self.model, self.engine, self.loss_fn, x, y)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for ``x`` with the current parameters (call after ``engine.synchronize``)."""
        self.model.eval()
        with torch.no_grad():
            return self.model(x)

    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        self.engine.synchronize()
        average_buffers(self.model)
        return score(self.predict, test, device)

    def checkpoint_scope(self) -> tuple[nn.Module, list[int] | None, dict[str, str] | None]:
        """The whole model, shared by the ranks the sync strategy keeps identical (all, or a cluster)."""
        return self.engine.model, self.engine.sync.replica_ranks(), None

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.model.state_dict() if rank == 0 else None
