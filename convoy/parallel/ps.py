"""Parameter-server layout: S server ranks hold the parameters, W workers train; one engine on every rank.

Servers read no data. Each trains its :class:`~convoy.ps.job.Shard` with an
ordinary :class:`~convoy.engine.Engine` whose strategy
(:class:`~convoy.ps.server.ServeShard`) collects the workers' pushes: the
update, the optimizer state and a checkpoint's snapshot of the shard live
there. Workers train the whole model with an engine whose strategy
(:class:`~convoy.ps.worker.PushPull`) pushes each layer's compressed gradient
and pulls back its parameters. Evaluation is the workers' (servers add
nothing); the full state comes from the first worker.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.compress import Compressor, Memory
from convoy.data import shard_indices
from convoy.engine import Engine
from convoy.engine.gradients import GradientGate, LossScaler
from convoy.errors import UsageError
from convoy.parallel.base import ParallelLayout
from convoy.parallel.groups import ProcessGroups
from convoy.parallel.precision import Precision
from convoy.ps.job import PSJob, Shard, build_job
from convoy.ps.push import RowCodec
from convoy.ps.roles import PSRoles
from convoy.ps.scheduler import SliceScheduler
from convoy.ps.server import ServeShard
from convoy.ps.settings import PSSettings
from convoy.ps.timeline import Timeline
from convoy.ps.worker import PushPull
from convoy.sync.pipeline import CompressionPipeline
from convoy.parallel.scoring import chunks, finish, tally

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def server_engine(job: PSJob, rank: int, optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any],
                  lr_lambda: Callable[[int], float] | None, timeline: Timeline | None,
                  gate: GradientGate | None = None, buffers_of: nn.Module | None = None,
                  scheduler: SliceScheduler | None = None) -> Engine:
    """The engine of server ``rank``: its shard, updated as the workers' pushes arrive (``gate``: clipping
    and fp16 unscaling of the averaged gradient, its group the job's ranks, so the norm spans every shard;
    ``buffers_of``: the model whose buffers the shard mirrors, so that its checkpoint holds them;
    ``scheduler``: the sender it replies through, default its own)."""
    if not job.layers_of(rank):
        raise UsageError(f"--servers {job.roles.servers}: server rank {rank} would hold no layer (the model has "
                         f"{len(job.layers)}); use fewer servers")
    # Under staleness a colocated rank's worker computes on older parameters than its server updates.
    shard = Shard(job, job.layers_of(rank), buffers_of=buffers_of, own_storage=job.settings.staleness > 0)
    sync = ServeShard(job, rank, shard, timeline, scheduler)
    return Engine(shard, optimizer_class, sync, listeners=sync.listeners(), lr_lambda=lr_lambda, bucket_bytes=0,
                  gate=gate, **hyper)


def worker_engine(job: PSJob, rank: int, part: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                  hyper: dict[str, Any], lr_lambda: Callable[[int], float] | None, compressor: Compressor | None,
                  memory: Memory | None, warmup_steps: int, timeline: Timeline | None,
                  agreement_group: dist.ProcessGroup | None = None, gate: GradientGate | None = None,
                  scheduler: SliceScheduler | None = None) -> Engine:
    """The engine of worker ``rank`` training ``part``: pushes and pulls, the update on the servers
    (``agreement_group``: every worker of ``part``'s layers, for compressors that agree, e.g. PowerSGD;
    ``gate``: the servers' clipping and loss scaling, which this worker follows to keep its loss scale;
    ``scheduler``: the sender it pushes through, default its own)."""
    sync = PushPull(job, rank, part, compressor, memory, warmup_steps, timeline, agreement_group, scheduler)
    return Engine(part, optimizer_class, sync, listeners=sync.listeners(), lr_lambda=lr_lambda, bucket_bytes=0,
                  gate=gate, **hyper)


def _join(worker: Engine, server: Engine) -> None:
    """Colocated: this rank's worker pushes its own units to its server in memory, the server marks
    them pulled when it has updated them in place, and the worker closes the server between its halves."""
    worker_sync, server_sync = worker.sync, server.sync
    assert isinstance(worker_sync, PushPull) and isinstance(server_sync, ServeShard), (worker_sync, server_sync)
    worker_sync.attach_local_server(server_sync, server)
    server_sync.attach_local_worker(worker_sync, worker)


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
        compressor, memory, warmup_steps: how workers compress their pushes
            (the objects all-reduce uses; default: none).
        grad_accum, amp, scaler: the workers' micro-batches, autocast and fp16
            loss scaler (see :class:`~convoy.parallel.precision.Precision`).
        gate: clipping and fp16 unscaling, on the servers (the workers follow
            its decisions); its group must hold every rank of the job when
            there are several servers or a loss scaler.
        groups: the job's process groups, with ``ps=settings`` (its channels and the workers' group).

    Example::

        >>> settings, world = PSSettings(servers=1), dist.get_world_size()
        >>> groups = ProcessGroups.create(JobShape(world, servers=1), ps=settings)   # on every rank
        >>> layout = ParameterServerLayout(model, settings, dist.get_rank(), world, torch.optim.SGD,
        ...                                {"lr": 0.05}, torch.zeros(32, 1, 32, 32), groups=groups)
        >>> loss, correct = layout.train_step(x, y)   # a worker trains; a server serves the step
    """

    def __init__(self, model: nn.Module, settings: PSSettings, rank: int, world_size: int,
                 optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any], example: torch.Tensor,
                 lr_lambda: Callable[[int], float] | None = None,
                 loss_fn: LossFn = nn.functional.cross_entropy, compressor: Compressor | None = None,
                 memory: Memory | None = None, warmup_steps: int = 0, grad_accum: int = 1, amp: str | None = None,
                 scaler: LossScaler | None = None, gate: GradientGate | None = None, *, groups: ProcessGroups):
        self.roles = PSRoles.colocate(world_size) if settings.colocated else PSRoles(settings.servers, world_size)
        self.model, self.rank, self.settings, self.loss_fn = model, rank, settings, loss_fn
        self.precision = Precision(grad_accum, amp, scaler)
        self.is_server = self.roles.is_server(rank) and not settings.colocated
        self.server_engine: Engine | None = None   # colocated: this rank's shard
        self._shared = False   # colocated: the shards restored from a checkpoint were shared
        self._served = (0, 0)    # colocated: the server's traffic at the last step_metrics
        if groups.channels is None or groups.channels.roles != self.roles:
            raise ValueError("groups must be created with this layout's settings: "
                             "ProcessGroups.create(..., ps=settings)")
        codec = RowCodec(CompressionPipeline(compressor, None, warmup_steps))
        self.job = build_job(model, groups.channels, settings, example, codec)
        self.routing = self.job.pull
        self.worker_group = groups.ps_workers
        self.timeline = (Timeline(rank, self._role(), settings.trace_steps) if settings.trace_steps else None)
        self.data_world_size = self.roles.num_workers
        if settings.colocated:
            self.data_rank = rank
            # One sender for the rank's pushes and its server's replies: they leave by the same link, so
            # they share one priority queue and one credit window (an urgent push goes ahead of bulk replies).
            sender = SliceScheduler.for_settings(settings, f"convoy-ps-send{rank}")
            self.server_engine = server_engine(self.job, rank, optimizer_class, hyper, lr_lambda, self.timeline, gate,
                                               buffers_of=model, scheduler=sender)
            self.engine = worker_engine(self.job, rank, model, optimizer_class, hyper, lr_lambda, compressor,
                                        memory, warmup_steps, self.timeline, self.worker_group, gate, sender)
            _join(self.engine, self.server_engine)
        elif self.is_server:
            self.data_rank = 0   # servers read batches only to keep the loop's pace
            self.engine = server_engine(self.job, rank, optimizer_class, hyper, lr_lambda, self.timeline, gate)
        else:
            self.data_rank = self.roles.worker_index(rank)
            self.engine = worker_engine(self.job, rank, model, optimizer_class, hyper, lr_lambda, compressor,
                                        memory, warmup_steps, self.timeline, self.worker_group, gate)
        # rank 0 shows progress: the workers tell it their losses (colocated, rank 0 trains and shows its own)
        self._reports = self.roles.is_server(0) and not settings.colocated

    # ------------------------------------------------------------- training
    def _role(self) -> str:
        return "colocated" if self.settings.colocated else "server" if self.is_server else "worker"

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        if self.server_engine is not None:   # colocated: this step's updates of the shard, as pushes arrive
            self._share_restored_shards()
            self.server_engine.run_step()
        if self.is_server:
            self.engine.run_step()
            return self._collect_reports() if self.rank == 0 else (0.0, 0)
        loss, correct = self.precision.train_step(self.model, self.engine, self.loss_fn, x, y)
        if self._reports:
            self.engine.sync.report(loss, correct, len(y))
        return loss, correct

    def _collect_reports(self) -> tuple[float, int]:
        from convoy.ps.wire import REPORT_TAG

        total = torch.zeros(3, dtype=torch.float64)
        message = torch.empty(3, dtype=torch.float64)
        for worker in self.roles.workers:
            dist.recv(message, worker, group=self.job.channels.group(0, worker, 0), tag=REPORT_TAG)
            total += message
        workers = self.roles.num_workers
        return total[0].item() / workers, round(total[1].item() / workers)

    def step_metrics(self, step: int) -> dict[str, Any]:
        """Colocated, also what the rank's server sent (replies) and took in (pushes) since the last call:
        its link carries both, and the worker engine's figures count only its pushes and pulls."""
        metrics: dict[str, Any] = {"role": self._role(), "priority": self.settings.priority}
        if self.server_engine is not None:
            sent, received = self.server_engine.sync.traffic()
            metrics["server_bytes_sent"], metrics["server_bytes_received"] = (sent - self._served[0],
                                                                              received - self._served[1])
            self._served = (sent, received)
        return metrics

    def checkpoint_engine(self) -> Engine:
        return self.server_engine if self.server_engine is not None else self.engine

    def _share_restored_shards(self) -> None:
        """Colocated, resumed: each rank restored its own shard; every owner now sends its units to the
        other ranks (a broadcast per unit, in unit order), so every replica holds the whole model."""
        if self._shared or self.server_engine.step == 0:
            self._shared = True
            return
        self._shared = True
        for unit, (_, _, params) in enumerate(self.job.layers):
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, self.job.server_of(unit), group=self.worker_group)
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def checkpoint_scope(self) -> tuple[nn.Module, list[int] | None, dict[str, str] | None]:
        """Colocated: every rank checkpoints its own shard (parameters, optimizer state, its worker's state and
        buffers) into its own files; resumed, the ranks then share their shards.
        One server: every rank checkpoints the server's shard, the server writing it (its parameters and
        optimizer state), the workers their own state (residuals, RNG, buffers) into their rank files."""
        if self.server_engine is not None:
            return self.server_engine.model, [self.rank], self.server_engine.model.full_names
        if self.is_server:
            return self.engine.model, None, self.engine.model.full_names
        shard = Shard(self.job, self.job.layers_of(self.roles.server_ranks[0]), buffers_of=self.model)
        return shard, None, shard.full_names

    # ----------------------------------------------------------- evaluation
    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        """Accuracy and mean loss over ``test``, scored by the workers in shards; a collective."""
        self.engine.synchronize()
        if self.server_engine is not None:
            self.server_engine.synchronize()
            self._share_restored_shards()
        totals = torch.zeros(3, dtype=torch.float64)
        if not self.is_server:
            self._average_buffers()
            self.model.eval()
            shard = shard_indices(len(test), self.roles.num_workers, self.data_rank)
            with torch.no_grad(), self.engine.sync.newest_parameters():
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
        if self.server_engine is not None:
            self._share_restored_shards()
        state: list[Any] = [None]
        if self.rank == self.roles.first_worker:
            with self.engine.sync.newest_parameters():   # copies: the block ends with older parameters in place
                state = [{name: value.clone() for name, value in self.model.state_dict().items()}]
        dist.broadcast_object_list(state, src=self.roles.first_worker)
        return state[0] if self.rank == 0 else None


class HybridServer(ParallelLayout):
    """A server rank of a hybrid job under ``--sync ps``: serves the conv layers to the conv group and
    the FC head to the FC group, and takes part in the hybrid layout's collectives.

    The servers are the job's last ranks, so the conv ranks (0..I-1) and FC ranks
    (I..I+J-1) are where :class:`~convoy.parallel.hybrid.HybridParallel` expects
    them. Each layer is averaged over the group that trains it.

    Args:
        job: the job's structure (built with the conv layers' workers and the head's).
        rank: this server's global rank.
        conv_ranks, fc_ranks: the two groups' ranks.
        optimizer_class, hyper, lr_lambda: the update the server runs.
        timeline: records spans for the Chrome trace, or ``None``.
        gate: clipping and fp16 unscaling of this server's layers, its group the
            job's ranks (the conv and FC workers follow it).
    """

    def __init__(self, job: PSJob, rank: int, conv_ranks: list[int], fc_ranks: list[int],
                 optimizer_class: type[torch.optim.Optimizer], hyper: dict[str, Any],
                 lr_lambda: Callable[[int], float] | None = None, timeline: Timeline | None = None,
                 gate: GradientGate | None = None):
        self.job, self.rank, self.timeline = job, rank, timeline
        self._fc_first = fc_ranks[0]
        self.data_rank, self.data_world_size = 0, len(conv_ranks)
        self.engine = server_engine(job, rank, optimizer_class, hyper, lr_lambda, timeline, gate)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        self.engine.run_step()
        return 0.0, 0

    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        self.engine.synchronize()
        return finish(torch.zeros(3, dtype=torch.float64))   # the workers score; the server adds nothing

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        head: list[Any] = [None]
        dist.broadcast_object_list(head, src=self._fc_first)   # HybridParallel's collective
        return None

    def step_metrics(self, step: int) -> dict[str, Any]:
        return {"role": "server"}
