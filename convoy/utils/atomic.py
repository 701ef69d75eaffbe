"""Files that are either whole or absent: written to a temporary name, synced, then renamed."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from convoy.errors import UsageError


def save_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that ``path`` never holds a partial file.

    A full disk or a kill mid-write leaves the old file (or none) and no
    temporary file behind; the error names ``path`` and the reason.

    Args:
        obj: anything torch.save accepts.
        path: the file to create or replace; its folder must exist.

    Example::

        >>> save_atomically({"w": torch.zeros(2)}, "runs/x/model.pt")   # doctest: +SKIP
    """
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path} is a directory; give a file name")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        # torch's zip writer reports a short write (a full disk) as a RuntimeError
        if isinstance(exc, (OSError, RuntimeError)):
            raise UsageError(f"cannot write {path}: {_reason(exc, path.parent)}") from None
        raise
    sync_folder(path.parent)


def _reason(exc: BaseException, folder: Path) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    free = shutil.disk_usage(folder).free
    return f"not enough space on its disk ({free / 1e6:.1f} MB free)" if free < 64 << 20 else str(exc).splitlines()[0]


def sync_folder(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable: its entry is on disk only after this.

    Example::

        >>> sync_folder(Path("runs/x"))   # doctest: +SKIP
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
