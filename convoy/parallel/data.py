"""Data parallelism: every rank holds the whole model and a slice of every batch."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.engine import Engine
from convoy.engine.gradients import LossScaler
from convoy.parallel.base import ParallelLayout
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
            ``torch.autocast`` in that type; ``None``: float32.
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
        self.grad_accum = grad_accum
        self.amp_dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
        self.scaler = scaler

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        self.model.train()
        # Equal micro-batches (the sampler hands grad_accum x batch-size samples)
        # make the mean of the micro-batch means the whole batch's mean loss.
        pieces = list(zip(x.tensor_split(self.grad_accum), y.tensor_split(self.grad_accum)))
        total_loss, correct = 0.0, 0
        for i, (x_part, y_part) in enumerate(pieces):
            with self._autocast(x_part.device):
                logits = self.model(x_part)
                loss = self.loss_fn(logits, y_part)
            scaled = loss / len(pieces) if len(pieces) > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale_loss(scaled)
            if i < len(pieces) - 1:
                self.engine.accumulate(scaled)
            else:
                self.engine.backward(scaled)
            total_loss += loss.item()
            correct += int((logits.argmax(1) == y_part).sum())
        return total_loss / len(pieces), correct

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)

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
