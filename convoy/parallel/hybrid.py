"""Hybrid parallelism: conv layers data-parallel on I workers, the FC head
data-parallel on J workers, and a model-parallel link between them.

Conv worker i (ranks 0..I-1) reads its slice of every global batch, runs the
feature extractor, and sends the activations and labels to FC worker
I + i // n (n = I / J). The FC worker stacks the activations of its n conv
workers, runs the head, and sends each conv worker the gradient of the loss
with respect to its activations. Each group's engine synchronises its own
layers layer by layer: conv gradients within the conv group, FC gradients
within the FC group. The FC head, its optimizer state and activations exist
only on FC workers (the nodes with expanded memory).

Scaling: the FC worker's loss is the mean over its n x b samples and the FC
group averages over J workers, so FC gradients are those of the mean over all
I x b samples; the activation gradient is multiplied by n so that each conv
worker holds the gradient of its own batch mean, which the conv group averages
over I. One hybrid step therefore equals one single-process step on the union batch.
With ``grad_accum`` N, each micro-batch crosses the link on its own and both
groups accumulate (the FC loss is divided by N), so a step still equals one on
the union of its N micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from convoy.data import shard_indices
from convoy.engine import Engine
from convoy.engine.gradients import LossScaler
from convoy.errors import UsageError
from convoy.models import split_point
from convoy.parallel.base import ParallelLayout
from convoy.parallel.precision import Precision, split_sizes
from convoy.parallel.scoring import EVAL_CHUNK, chunks, finish, tally

EngineFactory = Callable[[nn.Module, dist.ProcessGroup], Engine]


@dataclass(frozen=True)
class HybridRoles:
    """I conv workers (ranks 0..I-1) and J FC workers (ranks I..I+J-1); I divisible by J.

    Example::

        >>> roles = HybridRoles(4, 2)
        >>> roles.fc_of(3), roles.convs_of(4)
        (5, [0, 1])
    """

    conv_workers: int
    fc_workers: int

    def __post_init__(self) -> None:
        if self.conv_workers < 1 or self.fc_workers < 1:
            raise UsageError(f"--conv-workers and --fc-workers must be >= 1, got "
                             f"{self.conv_workers} and {self.fc_workers}")
        if self.conv_workers % self.fc_workers:
            raise UsageError(f"--conv-workers ({self.conv_workers}) must be divisible by "
                             f"--fc-workers ({self.fc_workers})")

    @property
    def world_size(self) -> int:
        return self.conv_workers + self.fc_workers

    @property
    def fan_in(self) -> int:
        """n: conv workers per FC worker."""
        return self.conv_workers // self.fc_workers

    def is_conv(self, rank: int) -> bool:
        return rank < self.conv_workers

    def fc_of(self, conv_rank: int) -> int:
        return self.conv_workers + conv_rank // self.fan_in

    def convs_of(self, fc_rank: int) -> list[int]:
        first = (fc_rank - self.conv_workers) * self.fan_in
        return list(range(first, first + self.fan_in))


class HybridParallel(ParallelLayout):
    """This rank's role in a hybrid job.

    Args:
        model: the whole model, built identically on every rank; only this
            rank's part is kept.
        roles: how many conv and FC workers.
        rank: this process's global rank.
        input_shape: (C, H, W) of one sample, to size the activations received.
        make_engine: ``(part, group) -> Engine`` for this rank's part and group.
        engine_groups: the conv workers' process group and the FC workers'
            (:attr:`convoy.parallel.groups.ProcessGroups.engines`, created on every rank).
        split_at: the child module where the head begins (see ``split_point``).
        loss_fn: per-sample loss, ``(logits, labels) -> losses`` with reduction "none".
        sub_batches: K; conv workers send their activations in K pieces, and the FC
            worker runs the head's forward on each piece as it arrives, so the link
            carries piece k + 1 while piece k is computed on both sides (Dettmers'
            variant). Batch-norm layers then see K smaller batches.
        servers: parameter-server ranks after the conv and FC ranks (``--sync ps``);
            they take part in this layout's collectives (convoy.parallel.ps.HybridServer).
        grad_accum: N micro-batches a step; each crosses the link on its own
            (activations out, their gradient back) and both groups' engines
            accumulate, so the step equals one on the N-times larger batch.
        amp: ``"bf16"`` or ``"fp16"`` autocast of both parts' forward (the link
            carries float32); ``None`` or ``"off"``: float32.
        scaler: the fp16 loss scaler: the FC worker scales the loss, so both
            groups' gradients carry the scale, which each engine's gate (whose
            group spans both groups) divides out.
    """

    def __init__(self, model: nn.Module, roles: HybridRoles, rank: int, input_shape: tuple[int, ...],
                 make_engine: EngineFactory, split_at: str | None = None,
                 loss_fn: Callable = nn.functional.cross_entropy, sub_batches: int = 1, servers: int = 0,
                 grad_accum: int = 1, amp: str | None = None, scaler: LossScaler | None = None, *,
                 engine_groups: tuple[dist.ProcessGroup | None, ...]):
        if sub_batches < 1:
            raise UsageError(f"--sub-batches must be >= 1, got {sub_batches}")
        self.sub_batches = sub_batches
        self.precision = Precision(grad_accum, amp, scaler)
        if roles.world_size + servers != dist.get_world_size():
            raise UsageError(f"--conv-workers + --fc-workers{' + --servers' if servers else ''} = "
                             f"{roles.world_size + servers} but the job has {dist.get_world_size()} processes")
        self.roles, self.rank, self.loss_fn = roles, rank, loss_fn
        features, head = split_point(model, split_at)
        with torch.no_grad():
            self.feature_shape = tuple(features(torch.zeros(1, *input_shape)).shape[1:])
        names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        if len(engine_groups) != 2:
            raise ValueError(f"hybrid parallelism has two engine groups (conv, FC), got {len(engine_groups)}")
        self.part = features if roles.is_conv(rank) else head
        self.group_ranks = list(range(roles.conv_workers) if roles.is_conv(rank)
                                else range(roles.conv_workers, roles.world_size))
        self._names = {key: names[id(t)] for key, t in self.part.state_dict(keep_vars=True).items()}
        self.engine = make_engine(self.part, engine_groups[0] if roles.is_conv(rank) else engine_groups[1])
        self.data_rank = rank if roles.is_conv(rank) else 0
        self.data_world_size = roles.conv_workers
        self.link_bytes_sent = self.link_bytes_received = 0
        self._link_by_step: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------- training
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        before = (self.link_bytes_sent, self.link_bytes_received)
        if self.roles.is_conv(self.rank):
            result = self._conv_step(x, y)
        else:
            result = self._fc_step(len(y))
        self._link_by_step[self.engine.step - 1] = (self.link_bytes_sent - before[0],
                                                    self.link_bytes_received - before[1])
        return result

    def checkpoint_scope(self) -> tuple[nn.Module, list[int], dict[str, str]]:
        """Each group persists its own layers: the conv part on the conv ranks, the head on the FC
        ranks (on a cluster of them under hierarchical sync)."""
        return self.part, self.engine.sync.replica_ranks() or self.group_ranks, self._names

    def step_metrics(self, step: int) -> dict[str, Any]:
        sent, received = self._link_by_step.pop(step, (0, 0))
        return {"role": "conv" if self.roles.is_conv(self.rank) else "fc",
                "link_bytes_sent": sent, "link_bytes_received": received}

    def _conv_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        self.part.train()
        total_loss, correct = 0.0, 0
        for last, (x_part, y_part) in self.precision.micro_batches(x, y):
            loss, hits = self._conv_micro_batch(x_part, y_part, last)
            total_loss, correct = total_loss + loss, correct + hits
        return total_loss / self.precision.grad_accum, correct

    def _conv_micro_batch(self, x: torch.Tensor, y: torch.Tensor, last: bool) -> tuple[float, int]:
        fc = self.roles.fc_of(self.rank)
        self._send(y, fc)
        pieces, sends = [], []
        for piece in x.tensor_split(self.sub_batches):
            with self.precision.autocast(piece.device):
                features = self.part(piece)
            pieces.append(features.float())   # the link carries float32 whatever the autocast type
            sends.append(self._isend(pieces[-1].detach().contiguous(), fc))
        activations = torch.cat(pieces)
        grad = self._recv(torch.empty_like(activations), fc)
        loss_and_correct = self._recv(torch.empty(2, dtype=torch.float64), fc)
        for work in sends:
            work.wait()
        # The FC worker's gradient already carries the 1/N of accumulation and the fp16 loss scale.
        self.precision.hand_over(self.engine, activations, last, grad)
        return loss_and_correct[0].item(), int(loss_and_correct[1])

    def _fc_step(self, batch: int) -> tuple[float, int]:
        self.part.train()
        total_loss, correct = 0.0, 0
        sizes = self.precision.sizes(batch)
        for i, size in enumerate(sizes):
            loss, hits = self._fc_micro_batch(size, i == len(sizes) - 1)
            total_loss, correct = total_loss + loss, correct + hits
        return total_loss / len(sizes), correct

    def _fc_micro_batch(self, batch: int, last: bool) -> tuple[float, int]:
        convs = self.roles.convs_of(self.rank)
        labels = [self._recv(torch.empty(batch, dtype=torch.int64), conv) for conv in convs]
        sizes = split_sizes(batch, self.sub_batches)   # the conv workers' pieces
        inputs: list[list[torch.Tensor]] = [[] for _ in convs]
        outputs: list[list[torch.Tensor]] = [[] for _ in convs]
        for size in sizes:   # piece-major: every conv worker's piece k before anyone's piece k + 1
            for i, conv in enumerate(convs):
                piece = self._recv(torch.empty(size, *self.feature_shape), conv).requires_grad_(True)
                inputs[i].append(piece)
                with self.precision.autocast(piece.device):
                    outputs[i].append(self.part(piece))
        logits, labels = torch.cat([torch.cat(out) for out in outputs]), torch.cat(labels)
        with self.precision.autocast(logits.device):
            losses = self.loss_fn(logits, labels, reduction="none")
        loss = losses.mean()
        self.precision.hand_over(self.engine, self.precision.scale(loss), last)
        hits = (logits.argmax(1) == labels).double()
        for i, (conv, part_loss, part_hits) in enumerate(zip(convs, losses.detach().double().chunk(len(convs)),
                                                             hits.chunk(len(convs)))):
            grad = torch.cat([piece.grad for piece in inputs[i]]) * self.roles.fan_in
            self._send(grad, conv)
            self._send(torch.stack([part_loss.mean(), part_hits.sum()]), conv)
        return loss.item(), int(hits.sum())

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, dst)
        self.link_bytes_sent += tensor.numel() * tensor.element_size()

    def _isend(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        self.link_bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst)

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, src)
        self.link_bytes_received += tensor.numel() * tensor.element_size()
        return tensor

    # ----------------------------------------------------------- evaluation
    def evaluate(self, test: torch.utils.data.Dataset, device: torch.device) -> tuple[float, float]:
        """Accuracy and mean loss over ``test``: conv workers score their shards through their FC worker."""
        self.engine.synchronize()
        self.part.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            if self.roles.is_conv(self.rank):
                self._eval_conv(test, device)
            else:
                totals = self._eval_fc(len(test))
        return finish(totals)

    def _eval_conv(self, test: torch.utils.data.Dataset, device: torch.device) -> None:
        fc = self.roles.fc_of(self.rank)
        for x, y in chunks(test, shard_indices(len(test), self.roles.conv_workers, self.rank)):
            dist.send(self.part(x.to(device)).contiguous(), fc)
            dist.send(y, fc)

    def _eval_fc(self, test_size: int) -> torch.Tensor:
        totals = torch.zeros(3, dtype=torch.float64)
        for conv in self.roles.convs_of(self.rank):
            # Shard sizes are known on both sides, so no sizes cross the link.
            shard = shard_indices(test_size, self.roles.conv_workers, conv)
            for begin in range(shard.start, shard.stop, EVAL_CHUNK):
                size = min(EVAL_CHUNK, shard.stop - begin)
                acts, labels = torch.empty(size, *self.feature_shape), torch.empty(size, dtype=torch.int64)
                dist.recv(acts, conv)
                dist.recv(labels, conv)
                totals += tally(self.part(acts), labels)
        return totals

    # --------------------------------------------------------------- saving
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state on rank 0 (None elsewhere): the head travels from FC worker 0."""
        mine = {self._names[k]: t.detach() for k, t in self.part.state_dict().items()}
        head = [mine if self.rank == self.roles.conv_workers else None]
        dist.broadcast_object_list(head, src=self.roles.conv_workers)
        return {**mine, **head[0]} if self.rank == 0 else None
