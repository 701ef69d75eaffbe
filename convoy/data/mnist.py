"""MNIST from its four IDX files, raw or gzipped, flat or in torchvision's MNIST/raw layout."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from convoy.data.files import locate, read_bytes, require_data_dir
from convoy.data.idx import parse_uint8_idx
from convoy.data.splits import DatasetSplits
from convoy.data.tensors import uint8_dataset
from convoy.errors import UsageError

MEAN = (0.1307,)
STD = (0.3081,)
IMAGE_SIZE = (28, 28)
NUM_CLASSES = 10
_SUBDIRS = ("", "MNIST/raw")
_SUFFIXES = ("", ".gz")
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _find(root: Path, name: str) -> Path:
    path = locate(root, name, _SUBDIRS, _SUFFIXES)
    if path is None:
        expected = ", ".join(n for pair in _FILES.values() for n in pair)
        raise UsageError(
            f"{root / name}: missing; expected the MNIST IDX files {expected} "
            f"(each raw or .gz, in {root} or {root / 'MNIST' / 'raw'})"
        )
    return path


def _load_split(root: Path, images_name: str, labels_name: str) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find(root, images_name)
    labels_path = _find(root, labels_name)
    images = parse_uint8_idx(read_bytes(images_path), images_path, 3, "uint8 images, 3 dims")
    labels = parse_uint8_idx(read_bytes(labels_path), labels_path, 1, "uint8 labels, 1 dim")
    if images.shape[1:] != IMAGE_SIZE:
        raise UsageError(
            f"{images_path}: expected 28x28 images, found {images.shape[1]}x{images.shape[2]}"
        )
    if len(labels) != len(images):
        raise UsageError(f"{labels_path}: has {len(labels)} labels but {images_path} has {len(images)} images")
    if len(labels) and int(labels.max()) >= NUM_CLASSES:
        raise UsageError(f"{labels_path}: labels must be 0..9, found {int(labels.max())}")
    return images[:, None], labels


def load(data_dir: str | None) -> DatasetSplits:
    """Load MNIST into memory, pixels scaled to [0, 1] then normalised with mean 0.1307, std 0.3081.

    Args:
        data_dir: folder holding the IDX files, or an ``MNIST/raw/`` folder holding them.

    Raises:
        UsageError: no data_dir, or a file is missing or malformed.
    """
    root = require_data_dir(data_dir, "mnist")
    train = uint8_dataset(*_load_split(root, *_FILES["train"]), MEAN, STD)
    test = uint8_dataset(*_load_split(root, *_FILES["test"]), MEAN, STD)
    return DatasetSplits(train, test, in_channels=1, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES)
