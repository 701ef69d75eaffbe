"""CIFAR-10 from its "python version" pickle batches."""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from convoy.data.files import locate, read_bytes, require_data_dir
from convoy.data.splits import DatasetSplits
from convoy.data.tensors import uint8_dataset
from convoy.errors import UsageError

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
NUM_CLASSES = 10
_SHAPE = (3, 32, 32)
_SUBDIRS = ("", "cifar-10-batches-py")
_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST = ("test_batch",)

# Unpickling runs whatever callables a file names, so only the few a batch of
# numpy arrays needs are allowed; anything else is a malformed (or hostile) file.
_ALLOWED_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _unpickle(path: Path) -> Any:
    stream = io.BytesIO(read_bytes(path))
    try:
        # encoding="bytes" because the batches were pickled by Python 2: keys stay bytes.
        return _BatchUnpickler(stream, encoding="bytes").load()
    except Exception as exc:  # a corrupt pickle can raise almost any exception type
        raise UsageError(f"{path}: not a CIFAR-10 python batch (cannot unpickle: {exc})") from None


def _load_batch(root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    path = locate(root, name, _SUBDIRS)
    if path is None:
        raise UsageError(
            f"{root / name}: missing; expected the CIFAR-10 python batches data_batch_1..5 and test_batch "
            f"(in {root} or {root / 'cifar-10-batches-py'})"
        )
    batch = _unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise UsageError(f"{path}: expected a dict with keys b'data' and b'labels'")
    data, labels = batch[b"data"], batch[b"labels"]
    row = int(np.prod(_SHAPE))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row:
        found = f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise UsageError(f"{path}: expected b'data' to be a uint8 array N x {row}, found {found}")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise UsageError(f"{path}: expected b'labels' to be a list of ints") from None
    if labels.shape != (len(data),):
        raise UsageError(f"{path}: has {len(data)} images but {labels.size} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise UsageError(f"{path}: labels must be 0..9, found {labels.min()}..{labels.max()}")
    # Each row is the red plane, then green, then blue, each row-major 32x32.
    return data.reshape(-1, *_SHAPE), labels


def _load_split(root: Path, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    images, labels = zip(*(_load_batch(root, name) for name in names))
    return np.concatenate(images), np.concatenate(labels)


def load(data_dir: str | None) -> DatasetSplits:
    """Load CIFAR-10 into memory, pixels scaled to [0, 1] then normalised per channel.

    Args:
        data_dir: folder holding ``data_batch_1`` .. ``data_batch_5`` and
            ``test_batch``, directly or in ``cifar-10-batches-py/``.

    Raises:
        UsageError: no data_dir, or a batch is missing or malformed.
    """
    root = require_data_dir(data_dir, "cifar10")
    train = uint8_dataset(*_load_split(root, _TRAIN), MEAN, STD)
    test = uint8_dataset(*_load_split(root, _TEST), MEAN, STD)
    return DatasetSplits(train, test, in_channels=_SHAPE[0], image_size=_SHAPE[1:], num_classes=NUM_CLASSES)
