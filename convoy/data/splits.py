"""The train/test pair every dataset loader returns, and how to describe a bare Dataset."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

from convoy.errors import UsageError


@dataclass(frozen=True)
class DatasetSplits:
    """A training set, a test set, and the shape facts a model needs to be built.

    Args:
        train: yields ``(x, y)`` with ``x`` a float32 ``(C, H, W)`` tensor and ``y`` an int.
        test: same format as ``train``.
        in_channels: ``C``.
        image_size: ``(H, W)``.
        num_classes: labels lie in ``0 .. num_classes - 1``.
    """

    train: Dataset
    test: Dataset
    in_channels: int
    image_size: tuple[int, int]
    num_classes: int


def describe_dataset(dataset: Dataset) -> DatasetSplits:
    """Wrap a single Dataset as both splits, inferring its shape facts.

    ``in_channels`` and ``image_size`` come from the first sample's ``x``, which
    must be a ``(C, H, W)`` tensor; ``num_classes`` is the largest label plus one,
    found by reading every label once (from the label tensor directly for a
    ``TensorDataset``). Factories that know these facts, or that have a
    separate test set, should return a ``DatasetSplits`` instead.

    Args:
        dataset: a map-style dataset yielding ``(x, y)`` pairs.

    Raises:
        UsageError: the dataset is empty, or its samples are not ``(tensor (C,H,W), label)``.
    """
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise UsageError("the custom dataset is empty")
    x = dataset[0][0]
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise UsageError(f"the custom dataset's samples must be (C, H, W) tensors, got {shape}")
    if isinstance(dataset, TensorDataset):
        labels = dataset.tensors[1]
    else:
        labels = torch.as_tensor([int(dataset[i][1]) for i in range(size)])
    if int(labels.min()) < 0:
        raise UsageError(f"the custom dataset has a negative label {int(labels.min())}")
    return DatasetSplits(
        train=dataset,
        test=dataset,
        in_channels=x.shape[0],
        image_size=(x.shape[1], x.shape[2]),
        num_classes=int(labels.max()) + 1,
    )
