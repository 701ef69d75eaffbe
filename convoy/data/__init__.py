"""Datasets for convoy: the built-ins, user factories, and worker-count-independent sampling.

``build_dataset`` is the entry point; every dataset it returns yields ``(x, y)``
with ``x`` a float32 ``(C, H, W)`` tensor and ``y`` an integer label.
"""
from __future__ import annotations

from typing import Callable

from torch.utils.data import Dataset

from convoy.data import cifar10, digits, mnist, synthetic
from convoy.data.sampler import GlobalBatchSampler, iterate_batches, shard_indices
from convoy.data.splits import DatasetSplits, describe_dataset
from convoy.errors import UsageError
from convoy.utils.imports import call_with_supported, is_import_path, load_object

__all__ = [
    "DATASET_NAMES",
    "DatasetSplits",
    "GlobalBatchSampler",
    "build_dataset",
    "iterate_batches",
    "shard_indices",
]

DATASET_NAMES = ("digits", "mnist", "cifar10", "synthetic")


def build_dataset(
    name: str,
    data_dir: str | None = None,
    *,
    synthetic_shape: tuple[int, int, int] = (3, 32, 32),
    synthetic_size: int = 4096,
    seed: int = 0,
) -> DatasetSplits:
    """Load a dataset by name.

    Args:
        name: one of ``DATASET_NAMES``, or ``package.module:factory``. The factory
            is called with ``data_dir`` if it accepts it, and returns either a
            ``DatasetSplits`` or one torch ``Dataset``, which is then used as
            both train and test set (see ``describe_dataset`` for how its
            shape and class count are inferred).
        data_dir: folder holding the files; required for mnist and cifar10.
        synthetic_shape: ``(C, H, W)`` of the synthetic images.
        synthetic_size: number of synthetic training samples.
        seed: seed of the synthetic data.

    Raises:
        UsageError: unknown name, missing data_dir, missing or malformed files,
            or a factory that cannot be loaded or returns something else.
    """
    if not isinstance(name, str):
        raise UsageError(f"dataset name must be a string, got {type(name).__name__}")
    loaders: dict[str, Callable[[], DatasetSplits]] = {
        "digits": digits.load,
        "mnist": lambda: mnist.load(data_dir),
        "cifar10": lambda: cifar10.load(data_dir),
        "synthetic": lambda: synthetic.load(synthetic_shape, synthetic_size, seed),
    }
    if name in loaders:
        return loaders[name]()
    if is_import_path(name):
        return _from_factory(name, data_dir)
    raise UsageError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}, "
                     "path/to/file.py:factory or package.module:factory")


def _from_factory(path: str, data_dir: str | None) -> DatasetSplits:
    try:
        factory = load_object(path)
    except ValueError as exc:
        raise UsageError(f"cannot load dataset factory: {exc}") from None
    result = call_with_supported(factory, data_dir=data_dir)
    if isinstance(result, DatasetSplits):
        return result
    if isinstance(result, Dataset):
        return describe_dataset(result)
    raise UsageError(
        f"dataset factory {path} returned {type(result).__name__}; expected DatasetSplits or a torch Dataset"
    )
