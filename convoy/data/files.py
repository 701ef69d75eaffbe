"""Finding and reading dataset files, reporting every failure as a UsageError naming the file."""
from __future__ import annotations

import gzip
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


def read_bytes(path: Path) -> bytes:
    """Read a file whole, decompressing it when its name ends in ``.gz``.

    Raises:
        UsageError: the file cannot be read or is not valid gzip.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"{path}: not valid gzip data: {exc}") from None
