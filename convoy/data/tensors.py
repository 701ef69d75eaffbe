"""Turning raw arrays into the normalised in-memory tensors the built-in datasets hold."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import TensorDataset


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Return ``(images - mean) / std`` per channel.

    Args:
        images: float tensor ``(N, C, H, W)``.
        mean: one value per channel.
        std: one value per channel.
    """
    mean_t = torch.tensor(mean, dtype=images.dtype).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=images.dtype).view(-1, 1, 1)
    return (images - mean_t) / std_t


def uint8_dataset(
    images: np.ndarray, labels: np.ndarray, mean: Sequence[float], std: Sequence[float]
) -> TensorDataset:
    """Scale uint8 ``(N, C, H, W)`` pixels to [0, 1], normalise, and pair them with int64 labels.

    Args:
        images: uint8 array ``(N, C, H, W)``.
        labels: integer array ``(N,)``.
        mean: per-channel mean of the [0, 1] pixels.
        std: per-channel standard deviation of the [0, 1] pixels.
    """
    # astype copies into a writable float array, which torch can share without a warning.
    pixels = torch.from_numpy(images.astype(np.float32) / np.float32(255))
    targets = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    return TensorDataset(normalize(pixels, mean, std), targets)
