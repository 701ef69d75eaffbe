"""Which file system a checkpoint directory is on, and whether it is DAX (persistent memory).

A DAX mount (``-o dax``, ext4/xfs on a pmem device) maps the file's pages
straight onto persistent memory: stores reach the medium without the page
cache, and ``msync`` is a cache flush. Anywhere else the store writes with
``pwrite`` and makes the bytes durable with ``fdatasync``.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FsInfo:
    """The mount holding a path: its mount point, type, options and free bytes."""

    mount_point: str
    fs_type: str
    options: tuple[str, ...]
    free_bytes: int

    @property
    def dax(self) -> bool:
        """True on a DAX mount (option ``dax`` or ``dax=always``; ``dax=inode`` counts too)."""
        return any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in self.options)

    def describe(self) -> str:
        kind = "DAX persistent memory" if self.dax else "no DAX: pwrite + fdatasync"
        return f"{self.fs_type} at {self.mount_point} ({kind})"


def fs_info(path: str | Path, mounts_file: str = "/proc/mounts") -> FsInfo:
    """Describe the file system of ``path`` (an existing file or directory).

    Args:
        path: where the checkpoint lives.
        mounts_file: the mount table to read (a test can pass its own).

    Example::

        >>> fs_info("/tmp").fs_type in ("tmpfs", "ext4", "xfs", "overlay", "btrfs")
        True
    """
    real = os.path.realpath(path)
    best = ("/", "unknown", ())
    try:
        with open(mounts_file) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, parts[2], tuple(parts[3].split(",")))
    except OSError:
        pass
    return FsInfo(best[0], best[1], best[2], shutil.disk_usage(real).free)
