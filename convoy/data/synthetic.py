"""Random images and labels, identical on every process, for smoke tests and benchmarks."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from convoy.data.splits import DatasetSplits
from convoy.errors import UsageError

NUM_CLASSES = 10


def load(shape: tuple[int, int, int] = (3, 32, 32), size: int = 4096, seed: int = 0) -> DatasetSplits:
    """Generate ``size`` training and ``size // 4`` test samples of standard-normal pixels.

    Args:
        shape: ``(C, H, W)`` of each image.
        size: number of training samples; at least 4 so the test split is not empty.
        seed: generator seed; every process passing the same seed gets the same data.

    Raises:
        UsageError: ``shape`` is not three positive ints, or ``size`` < 4.
    """
    if len(shape) != 3 or any(int(d) != d or d < 1 for d in shape):
        raise UsageError(f"synthetic shape must be three positive integers (C, H, W), got {tuple(shape)}")
    if size < 4:
        raise UsageError(f"synthetic size must be at least 4 (the test split is size // 4), got {size}")
    shape = tuple(int(d) for d in shape)
    generator = torch.Generator().manual_seed(seed)

    def split(n: int) -> TensorDataset:
        images = torch.randn((n, *shape), generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
        return TensorDataset(images, labels)

    train = split(size)
    test = split(size // 4)
    return DatasetSplits(train, test, in_channels=shape[0], image_size=shape[1:], num_classes=NUM_CLASSES)
