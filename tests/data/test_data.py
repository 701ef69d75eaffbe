"""Tests for convoy.data: built-in loaders, file validation, user factories, sampling."""
from __future__ import annotations

import gzip
import pickle
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from convoy.data import (
    DATASET_NAMES,
    GlobalBatchSampler,
    build_dataset,
    iterate_batches,
    shard_indices,
)
from convoy.errors import UsageError

# ---------------------------------------------------------------- digits


def test_digits_shapes_and_split():
    splits = build_dataset("digits")
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (1, (32, 32), 10)
    assert len(splits.train) + len(splits.test) == 1797
    x, y = splits.train[0]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32
    assert 0 <= int(y) < 10


def test_digits_is_deterministic():
    a, b = build_dataset("digits"), build_dataset("digits")
    for left, right in ((a.train, b.train), (a.test, b.test)):
        assert all(torch.equal(p, q) for p, q in zip(left.tensors, right.tensors))


# ---------------------------------------------------------------- mnist


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    magic = (0x08 << 8 | array.ndim) if magic is None else magic
    return struct.pack(f">i{array.ndim}i", magic, *array.shape) + array.astype(np.uint8).tobytes()


@pytest.fixture
def mnist_arrays():
    rng = np.random.default_rng(0)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 5, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 3, dtype=np.uint8),
    }


def write_mnist(folder: Path, arrays: dict, gz: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        data = idx_bytes(array)
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)


def expected_mnist(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images.astype(np.float32))[:, None] / 255 - 0.1307) / 0.3081


@pytest.mark.parametrize("subdir, gz", [("", False), ("", True), ("MNIST/raw", False), ("MNIST/raw", True)])
def test_mnist_round_trip(tmp_path, mnist_arrays, subdir, gz):
    write_mnist(tmp_path / subdir, mnist_arrays, gz=gz)
    splits = build_dataset("mnist", str(tmp_path))
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (1, (28, 28), 10)
    for split, prefix in ((splits.train, "train"), (splits.test, "t10k")):
        images, labels = split.tensors
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        torch.testing.assert_close(images, expected_mnist(mnist_arrays[f"{prefix}-images-idx3-ubyte"]))
        assert labels.tolist() == mnist_arrays[f"{prefix}-labels-idx1-ubyte"].tolist()


def test_mnist_requires_data_dir():
    with pytest.raises(UsageError, match="--data-dir"):
        build_dataset("mnist")


def corrupt_and_load(tmp_path: Path, arrays: dict, name: str, data: bytes) -> str:
    write_mnist(tmp_path, arrays)
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UsageError) as info:
        build_dataset("mnist", str(tmp_path))
    message = str(info.value)
    assert str(tmp_path / name) in message
    return message


def test_mnist_wrong_magic(tmp_path, mnist_arrays):
    name = "train-images-idx3-ubyte"
    bad = idx_bytes(mnist_arrays[name], magic=0x00000801)
    message = corrupt_and_load(tmp_path, mnist_arrays, name, bad)
    assert "expected IDX magic 0x00000803" in message and "found 0x00000801" in message


def test_mnist_truncated(tmp_path, mnist_arrays):
    name = "t10k-images-idx3-ubyte"
    bad = idx_bytes(mnist_arrays[name])[:-10]
    message = corrupt_and_load(tmp_path, mnist_arrays, name, bad)
    assert "truncated: header says 3x28x28 = 2352 bytes of data, file has 2342" in message


def test_mnist_trailing_bytes(tmp_path, mnist_arrays):
    name = "train-labels-idx1-ubyte"
    message = corrupt_and_load(tmp_path, mnist_arrays, name, idx_bytes(mnist_arrays[name]) + b"\0")
    assert "trailing data" in message


def test_mnist_count_mismatch(tmp_path, mnist_arrays):
    name = "train-labels-idx1-ubyte"
    message = corrupt_and_load(tmp_path, mnist_arrays, name, idx_bytes(mnist_arrays[name][:4]))
    assert "4 labels" in message and "5 images" in message


def test_mnist_bad_gzip(tmp_path, mnist_arrays):
    write_mnist(tmp_path, mnist_arrays)
    name = "train-images-idx3-ubyte"
    (tmp_path / name).unlink()
    (tmp_path / f"{name}.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UsageError, match="gzip") as info:
        build_dataset("mnist", str(tmp_path))
    assert str(tmp_path / f"{name}.gz") in str(info.value)


def test_mnist_missing_file(tmp_path, mnist_arrays):
    write_mnist(tmp_path, mnist_arrays)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(UsageError, match="missing") as info:
        build_dataset("mnist", str(tmp_path))
    assert str(tmp_path / "t10k-labels-idx1-ubyte") in str(info.value)


# ---------------------------------------------------------------- cifar10

CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_cifar(folder: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    batches = {}
    for name in CIFAR_BATCHES:
        batch = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, 2)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))
        batches[name] = batch
    return batches


@pytest.mark.parametrize("subdir, protocol", [("", 2), ("", 5), ("cifar-10-batches-py", 4)])
def test_cifar10_round_trip(tmp_path, subdir, protocol):
    batches = write_cifar(tmp_path / subdir, protocol)
    splits = build_dataset("cifar10", str(tmp_path))
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (3, (32, 32), 10)
    assert len(splits.train) == 10 and len(splits.test) == 2

    raw = batches["data_batch_1"][b"data"][0]
    x, y = splits.train[0]
    # The row holds the red 32x32 plane first, then green, then blue.
    red_top_left, green_top_left = raw[0], raw[1024]
    expected = torch.from_numpy(raw.reshape(3, 32, 32).astype(np.float32)) / 255
    torch.testing.assert_close(x, (expected - CIFAR_MEAN) / CIFAR_STD)
    torch.testing.assert_close(x[0, 0, 0], (red_top_left / 255 - CIFAR_MEAN[0, 0, 0]) / CIFAR_STD[0, 0, 0])
    torch.testing.assert_close(x[1, 0, 0], (green_top_left / 255 - CIFAR_MEAN[1, 0, 0]) / CIFAR_STD[1, 0, 0])
    assert int(y) == batches["data_batch_1"][b"labels"][0]

    all_train_labels = [label for name in CIFAR_BATCHES[:5] for label in batches[name][b"labels"]]
    assert splits.train.tensors[1].tolist() == all_train_labels
    assert splits.test.tensors[1].tolist() == batches["test_batch"][b"labels"]


def test_cifar10_missing_batch(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(UsageError, match="missing; expected the CIFAR-10 python batches") as info:
        build_dataset("cifar10", str(tmp_path))
    assert str(tmp_path / "data_batch_3") in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        b"this is not a pickle",
        pickle.dumps([1, 2, 3]),
        pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}),
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}),
        pickle.dumps(Path("/")),  # a global outside the allowed numpy ones
    ],
)
def test_cifar10_malformed_batch(tmp_path, content):
    write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(content)
    with pytest.raises(UsageError) as info:
        build_dataset("cifar10", str(tmp_path))
    assert str(tmp_path / "test_batch") in str(info.value)


# ---------------------------------------------------------------- synthetic


def test_synthetic_same_seed_same_data():
    a = build_dataset("synthetic", synthetic_shape=(2, 5, 7), synthetic_size=40, seed=3)
    b = build_dataset("synthetic", synthetic_shape=(2, 5, 7), synthetic_size=40, seed=3)
    c = build_dataset("synthetic", synthetic_shape=(2, 5, 7), synthetic_size=40, seed=4)
    assert (a.in_channels, a.image_size, a.num_classes) == (2, (5, 7), 10)
    assert len(a.train) == 40 and len(a.test) == 10
    assert a.train[0][0].shape == (2, 5, 7)
    for left, right in ((a.train, b.train), (a.test, b.test)):
        assert all(torch.equal(p, q) for p, q in zip(left.tensors, right.tensors))
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])


@pytest.mark.parametrize("shape, size", [((3, 32), 16), ((3, 0, 4), 16), ((3, 4, 4), 2)])
def test_synthetic_rejects_bad_arguments(shape, size):
    with pytest.raises(UsageError):
        build_dataset("synthetic", synthetic_shape=shape, synthetic_size=size)


# ---------------------------------------------------------------- names and factories

FACTORY_MODULE = '''
import torch
from torch.utils.data import Dataset, TensorDataset
from convoy.data import DatasetSplits

class Pairs(Dataset):
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return torch.full((2, 3, 4), float(i)), i % 4

def bare(data_dir):
    assert data_dir == "/some/dir"
    return Pairs()

def splits():
    ds = TensorDataset(torch.zeros(4, 1, 2, 2), torch.arange(4))
    return DatasetSplits(ds, ds, in_channels=1, image_size=(2, 2), num_classes=7)

def not_a_dataset():
    return 42
'''


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "convoy_test_factories.py").write_text(textwrap.dedent(FACTORY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "convoy_test_factories"


def test_factory_returning_bare_dataset(factory_module):
    splits = build_dataset(f"{factory_module}:bare", "/some/dir")
    assert splits.train is splits.test
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (2, (3, 4), 4)


def test_factory_returning_splits(factory_module):
    splits = build_dataset(f"{factory_module}:splits")
    assert splits.num_classes == 7


def test_factory_returning_something_else(factory_module):
    with pytest.raises(UsageError, match="returned int"):
        build_dataset(f"{factory_module}:not_a_dataset")


def test_factory_that_cannot_be_imported():
    with pytest.raises(UsageError, match="no_such_module_xyz"):
        build_dataset("no_such_module_xyz:factory")


def test_unknown_name_lists_choices():
    with pytest.raises(UsageError) as info:
        build_dataset("foo")
    assert str(info.value) == (
        "unknown dataset 'foo'; choose one of: digits, mnist, cifar10, synthetic, path/to/file.py:factory or package.module:factory"
    )
    assert DATASET_NAMES == ("digits", "mnist", "cifar10", "synthetic")


# ---------------------------------------------------------------- sampling


def epoch_batches(size: int, batch: int, world: int, rank: int, seed: int, epoch: int) -> list[list[int]]:
    sampler = GlobalBatchSampler(size, batch, world_size=world, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    batch=st.integers(1, 8),
    extra=st.integers(0, 50),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 100),
)
def test_global_batches_do_not_depend_on_world_size(world, batch, extra, seed, epoch):
    size = world * batch + extra
    single = epoch_batches(size, world * batch, 1, 0, seed, epoch)
    per_rank = [epoch_batches(size, batch, world, rank, seed, epoch) for rank in range(world)]
    assert len(single) == size // (world * batch)
    for rank_batches in per_rank:
        assert len(rank_batches) == len(single)
        assert all(len(b) == batch for b in rank_batches)
    for i, global_batch in enumerate(single):
        assert [idx for rank in range(world) for idx in per_rank[rank][i]] == global_batch
    seen = [idx for b in single for idx in b]
    assert len(seen) == len(set(seen)) and all(0 <= idx < size for idx in seen)


def test_epochs_reorder_and_repeat():
    first = epoch_batches(100, 10, 1, 0, seed=0, epoch=0)
    assert first == epoch_batches(100, 10, 1, 0, seed=0, epoch=0)
    assert first != epoch_batches(100, 10, 1, 0, seed=0, epoch=1)
    assert first != epoch_batches(100, 10, 1, 0, seed=1, epoch=0)
    assert sorted(i for b in first for i in b) == list(range(100))


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 0, 1, 0), "batch size"),
        ((10, 2, 0, 0), "world size"),
        ((10, 2, 2, 2), "rank"),
        ((10, 3, 4, 0), "only 10 samples, fewer than one global batch of 12"),
    ],
)
def test_sampler_validates_arguments(args, message):
    with pytest.raises(UsageError, match=message):
        GlobalBatchSampler(*args)


class ListDataset(Dataset):
    def __init__(self, n: int):
        self.items = [(torch.full((1, 2, 2), float(i)), i) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_iterate_batches_fast_and_generic_paths_agree():
    tensor_ds = torch.utils.data.TensorDataset(
        torch.arange(20, dtype=torch.float32).view(20, 1, 1, 1).expand(20, 1, 2, 2).contiguous(),
        torch.arange(20, dtype=torch.int32),
    )
    sampler = GlobalBatchSampler(20, 3, world_size=2, rank=1, seed=5)
    fast = list(iterate_batches(tensor_ds, sampler))
    slow = list(iterate_batches(ListDataset(20), sampler))
    assert len(fast) == len(slow) == 3
    for (xf, yf), (xs, ys), indices in zip(fast, slow, sampler):
        assert xf.shape == (3, 1, 2, 2) and yf.dtype == ys.dtype == torch.int64
        torch.testing.assert_close(xf, xs)
        assert yf.tolist() == ys.tolist() == indices


@given(n=st.integers(0, 200), world=st.integers(1, 9))
def test_shard_indices_cover_each_index_once(n, world):
    shards = [shard_indices(n, world, rank) for rank in range(world)]
    assert [i for shard in shards for i in shard] == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shard_indices_validates_rank():
    with pytest.raises(UsageError):
        shard_indices(10, 2, 2)
