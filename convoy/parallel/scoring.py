"""Scoring a model on a test set, split over ranks."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from convoy.data import shard_indices

EVAL_CHUNK = 512


def tally(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[correct predictions, samples, summed loss] of one chunk, to be added up over chunks and ranks."""
    return torch.tensor([(logits.argmax(1) == labels).sum().item(), len(labels),
                         nn.functional.cross_entropy(logits, labels, reduction="sum").item()], dtype=torch.float64)


def chunks(test: torch.utils.data.Dataset, shard: range) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``shard`` of ``test`` as stacked (inputs, labels) chunks of at most EVAL_CHUNK samples."""
    for begin in range(shard.start, shard.stop, EVAL_CHUNK):
        xs, ys = zip(*(test[i] for i in range(begin, min(begin + EVAL_CHUNK, shard.stop))))
        yield torch.stack(xs), torch.as_tensor(ys, dtype=torch.int64)


def finish(totals: torch.Tensor) -> tuple[float, float]:
    """All-reduce tallies over ranks; return (accuracy, mean loss)."""
    if dist.is_initialized():
        dist.all_reduce(totals)
    correct, count, loss_sum = totals.tolist()
    return correct / count, loss_sum / count


def score(predict: Callable[[torch.Tensor], torch.Tensor], test: torch.utils.data.Dataset,
          device: torch.device) -> tuple[float, float]:
    """Accuracy and mean loss of ``predict`` (inputs -> logits) on ``test``, each rank scoring a shard."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y in chunks(test, shard_indices(len(test), world, rank)):
        totals += tally(predict(x.to(device)), y.to(device))
    return finish(totals)


def average_buffers(model: nn.Module) -> None:
    """Average floating-point buffers (batch-norm statistics) over ranks before evaluation.

    Each rank's running statistics saw only its share of the batches; the
    average is what one process seeing all of them would hold, to first order.
    """
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer.data)
            buffer.data.div_(world)
