"""scikit-learn's embedded 8x8 digits, upsampled to 32x32: a real dataset that needs no download."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from convoy.data.splits import DatasetSplits
from convoy.data.tensors import normalize

CHANNELS = 1   # grey levels
IMAGE_SIZE = (32, 32)
NUM_CLASSES = 10
_MAX_PIXEL = 16.0


def load() -> DatasetSplits:
    """Load the 1797 digits, 80/20 stratified split with a fixed seed.

    Pixels are scaled to [0, 1], resized bilinearly to 32x32, then normalised
    with the training split's mean and standard deviation.
    """
    # Imported here, not with the module: scikit-learn pulls in scipy.stats (about 1.2 s of CPU),
    # which every ``import convoy`` (a launcher, a CLI command, a user's script) would otherwise pay.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.from_numpy(bunch.data.astype(np.float32) / _MAX_PIXEL).view(-1, 1, 8, 8)
    images = F.interpolate(images, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, random_state=0, stratify=bunch.target
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    mean, std = images[train_idx].mean().item(), images[train_idx].std().item()
    images = normalize(images, [mean], [std])
    return DatasetSplits(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        test=TensorDataset(images[test_idx], labels[test_idx]),
        in_channels=CHANNELS,
        image_size=IMAGE_SIZE,
        num_classes=NUM_CLASSES,
    )
