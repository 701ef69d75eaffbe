"""Global-batch sampling whose results do not depend on the number of workers.

The seed and epoch fix one shuffled order of the training set. Global batch
``i`` is the ``i``-th run of ``world_size * batch_size`` indices in that order,
whatever the world size; rank ``r`` takes the ``r``-th contiguous slice of it.
So N workers with batch ``b`` see exactly the batches one worker with batch
``N * b`` would, which keeps a run reproducible when it is resumed on a
different number of machines.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from convoy.errors import UsageError

# Spreads seeds apart so (seed, epoch) and (seed + 1, epoch - 1) never collide in practice.
_SEED_STRIDE = 1_000_003
# torch.Generator.manual_seed takes at most 64 bits.
_SEED_MODULUS = 2**64


def _check_rank(world_size: int, rank: int) -> None:
    if world_size < 1:
        raise UsageError(f"world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise UsageError(f"rank must be in 0..{world_size - 1}, got {rank}")


class GlobalBatchSampler:
    """Yields, for one rank, the index lists of its share of each global batch.

    Args:
        dataset_size: number of training samples.
        batch_size: samples per worker per step; a global batch is ``world_size * batch_size``.
        world_size: number of workers.
        rank: this worker, ``0 <= rank < world_size``.
        seed: together with the epoch, fixes the shuffled order.

    Raises:
        UsageError: a non-positive size, a rank out of range, or a dataset
            smaller than one global batch.
    """

    def __init__(self, dataset_size: int, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0):
        if batch_size < 1:
            raise UsageError(f"batch size must be at least 1, got {batch_size}")
        _check_rank(world_size, rank)
        if seed < 0:
            raise UsageError(f"seed must be non-negative, got {seed}")
        global_batch = world_size * batch_size
        if dataset_size < global_batch:
            raise UsageError(
                f"the dataset has only {dataset_size} samples, fewer than one global batch of {global_batch} "
                f"({world_size} workers x batch size {batch_size})"
            )
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffled order the next iteration follows.

        Args:
            epoch: non-negative epoch number.
        """
        if epoch < 0:
            raise UsageError(f"epoch must be non-negative, got {epoch}")
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed((self.seed * _SEED_STRIDE + self.epoch) % _SEED_MODULUS)
        order = torch.randperm(self.dataset_size, generator=generator)
        global_batch = self.world_size * self.batch_size
        offset = self.rank * self.batch_size
        for start in range(0, len(self) * global_batch, global_batch):
            yield order[start + offset : start + offset + self.batch_size].tolist()

    def __len__(self) -> int:
        """Global batches per epoch; the last incomplete one is dropped."""
        return self.dataset_size // (self.world_size * self.batch_size)


def iterate_batches(dataset: Dataset, sampler: GlobalBatchSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield stacked ``(x, y)`` for each index list the sampler gives, with ``y`` int64.

    Args:
        dataset: map-style dataset of ``(x, y)`` pairs.
        sampler: gives this rank's indices for each global batch.
    """
    for indices in sampler:
        if isinstance(dataset, TensorDataset):
            # Indexing the in-memory tensors at once avoids a Python loop over samples.
            index = torch.as_tensor(indices)
            x, y = dataset.tensors[0][index], dataset.tensors[1][index]
        else:
            x, y = default_collate([dataset[i] for i in indices])
        yield x, torch.as_tensor(y).long()


def shard_indices(n: int, world_size: int, rank: int) -> range:
    """This rank's contiguous share of ``0 .. n - 1``, for evaluating a dataset in parts.

    Shards differ in size by at most one and together cover every index once.

    Args:
        n: number of items.
        world_size: number of workers.
        rank: this worker, ``0 <= rank < world_size``.
    """
    if n < 0:
        raise UsageError(f"number of items must be non-negative, got {n}")
    _check_rank(world_size, rank)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
