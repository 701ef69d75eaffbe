"""Parameter-server layout (seed 004): S server ranks hold the parameters, W workers train.

The first S ranks are servers: they read no data, hold their shard of the
layers and its optimizer state, and serve one step per ``train_step``. The
other W ranks are workers: each reads its 1/W of every global batch, pushes
gradients and pulls parameters. Evaluation is the workers' (servers add
nothing); the full state comes from the first worker.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.data import shard_indices
from convoy.parallel.base import ParallelLayout
from convoy.ps.channels import Channels
from convoy.ps.plan import agree_on_plan
from convoy.ps.roles import PSRoles
from convoy.ps.routing import build_routing
from convoy.ps.server import ParameterServer
from convoy.ps.settings import PSSettings
from convoy.ps.timeline import Timeline
from convoy.ps.trace_graph import model_layers
from convoy.ps.worker import PSWorker
from convoy.train.scoring import chunks, finish, tally

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParameterServerLayout(ParallelLayout):
    """This rank's role in a parameter-server job.

    Args:
        model: the whole model, identical on every rank.
        settings: servers, priority mode, channels, slices, credit, trace.
        rank, world_size: this process's place in the job.
        optimizer_class, hyper: the servers' optimizer and its hyper-parameters.
        example: a batch like the training batches (traced for the priorities).
        lr_lambda: ``step -> factor`` of the learning rate, or ``None``.
        loss_fn: ``(logits, labels) -> scalar`` mean loss.

    Example::

        >>> layout = ParameterServerLayout(model, PSSettings(servers=1), dist.get_rank(), dist.get_world_size(),
        ...                                torch.optim.SGD, {"lr": 0.05}, torch.zeros(32, 1, 32, 32))
        >>> loss, correct = layout.train_step(x, y)   # a worker trains; a server serves the step
    """

    def __init__(self, model: nn.Module, settings: PSSettings, rank: int, world_size: int,
                 optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any], example: torch.Tensor,
                 lr_lambda: Callable[[int], float] | None = None,
                 loss_fn: LossFn = nn.functional.cross_entropy):
        self.roles = PSRoles(settings.servers, world_size)
        self.model, self.rank, self.settings, self.loss_fn = model, rank, settings, loss_fn
        self.is_server = self.roles.is_server(rank)
        # Process groups are created collectively, in the same order on every rank.
        self.channels = Channels(self.roles, settings.channels, rank)
        self.worker_group = dist.new_group(self.roles.workers)
        self.plan = agree_on_plan(model, self.roles, rank, settings.priority, example)
        numels = [sum(p.numel() for p in params) for _, _, params in model_layers(model)]
        self.routing = build_routing(numels, self.plan, settings)
        self.timeline = (Timeline(rank, "server" if self.is_server else "worker", settings.trace_steps)
                         if settings.trace_steps else None)
        self.data_world_size = self.roles.num_workers
        if self.is_server:
            self.data_rank = 0   # servers read batches only to keep the loop's pace
            self.engine = ParameterServer(model, self.roles, rank, self.channels, self.routing, settings,
                                          optimizer_class, hyper, lr_lambda, self.timeline)
        else:
            self.data_rank = self.roles.worker_index(rank)
            self.engine = PSWorker(model, self.roles, rank, self.channels, self.routing, settings, self.timeline,
                                   self.plan.unseen)

    # ------------------------------------------------------------- training
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        if self.is_server:
            return self.engine.serve_step()
        self.model.train()
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        self.engine.backward(loss)
        correct = int((logits.argmax(1) == y).sum())
        self.engine.report(loss.item(), correct, len(y))
        return loss.item(), correct

    def step_metrics(self, step: int) -> dict[str, Any]:
        return {"role": "server" if self.is_server else "worker", "priority": self.settings.priority}

    # ----------------------------------------------------------- evaluation
    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        """Accuracy and mean loss over ``test``, scored by the workers in shards; a collective."""
        self.engine.synchronize()
        totals = torch.zeros(3, dtype=torch.float64)
        if not self.is_server:
            self._average_buffers()
            self.model.eval()
            shard = shard_indices(len(test), self.roles.num_workers, self.data_rank)
            with torch.no_grad():
                for x, y in chunks(test, shard):
                    totals += tally(self.model(x.to(device)), y.to(device))
        return finish(totals)

    def _average_buffers(self) -> None:
        # Batch-norm statistics live on the workers, each from its own batches.
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer.data, group=self.worker_group)
                buffer.data.div_(self.roles.num_workers)

    # --------------------------------------------------------------- saving
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0 (None elsewhere), from the first worker; a collective."""
        state = [self.model.state_dict() if self.rank == self.roles.first_worker else None]
        dist.broadcast_object_list(state, src=self.roles.first_worker)
        return state[0] if self.rank == 0 else None

    def save_trace(self, run_dir: Path) -> None:
        """Write this rank's timeline (``--trace``) into ``run_dir``."""
        if self.timeline is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.timeline.save(run_dir)
