"""Finding and reading dataset files, reporting every failure as a UsageError naming the file."""
from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import Sequence

from convoy.errors import UsageError


def require_data_dir(data_dir: str | None, dataset: str) -> Path:
    """Return ``data_dir`` as a Path, insisting that it was given and is a directory.

    Args:
        data_dir: the ``--data-dir`` value, possibly None.
        dataset: the dataset's name, for the message.
    """
    if data_dir is None:
        raise UsageError(f"--data-dir is required for the {dataset} dataset: the folder holding its files")
    path = Path(data_dir)
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory; --data-dir must be the folder holding the {dataset} files")
    return path


def locate(root: Path, name: str, subdirs: Sequence[str], suffixes: Sequence[str] = ("",)) -> Path | None:
    """Return the first existing ``root/subdir/name+suffix``, or None.

    Args:
        root: the data directory.
        name: the file's base name.
        subdirs: folders under ``root`` to try, in order; ``""`` is ``root`` itself.
        suffixes: name endings to try within each folder, in order.
    """
    for subdir in subdirs:
        for suffix in suffixes:
            candidate = root / subdir / (name + suffix)
            if candidate.is_file():
                return candidate
    return None


# Larger than any dataset file convoy reads (MNIST's training images are 47 MB);
# a gzip bomb stops here instead of exhausting the memory.
MAX_DECOMPRESSED_BYTES = 1 << 30


def read_bytes(path: Path, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """Read a file whole, decompressing it when its name ends in ``.gz``, up to ``limit`` bytes.

    Raises:
        UsageError: the file cannot be read, is not valid gzip, or decompresses past ``limit``.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if path.suffix != ".gz":
        return raw
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            data = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"{path}: not valid gzip data: {exc}") from None
    if len(data) > limit:
        raise UsageError(f"{path}: decompresses to more than {limit >> 20} MB; not a dataset file")
    return data
