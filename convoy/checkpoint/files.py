"""The job's checkpoint files by name, and other writers' files followed for their newest step.

One rank per node (local rank 0, "the writer") keeps the parameters in
``model-rank<writer>.ckpt``; every rank keeps its own state in
``state-rank<rank>.ckpt``. A persister waits on the files of its peers before
it overwrites an area (:mod:`convoy.checkpoint.persister`): a :class:`PeerFile`
on this machine, a :class:`RemoteWriter` (a key of the job's store) for a
writer on another machine.

Example::

    >>> committed_step(model_file(Path("ckpt"), 0))   # -1: no file, or no intact commit yet
    -1
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convoy.checkpoint.difflog import log_path, read_chain
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.store import AREAS, Store


def model_file(directory: Path, writer_rank: int) -> Path:
    """The model file ``writer_rank`` writes (one per node, or per hybrid group, shard or cluster)."""
    return directory / f"model-rank{writer_rank}.ckpt"


def rank_file(directory: Path, rank: int) -> Path:
    """The file of ``rank``'s own state (buffers, error-feedback residuals, RNG)."""
    return directory / f"state-rank{rank}.ckpt"


def committed_step(path: Path) -> int:
    """The newest step ``path`` can restore (an intact commit record, or a record of its
    differential log after it); -1 when none (or no file). Slot checksums are not checked."""
    peer = PeerFile(path)
    try:
        return peer.committed_step()
    finally:
        peer.close()


class RemoteWriter:
    """Another machine's model-file writer, followed through the job's store: its files are on that
    machine's disk, so its newest committed step travels as a key of the store instead.

    Args:
        store: the job's store (the default process group's).
        rank: the writer's rank.
    """

    def __init__(self, store: Any, rank: int):
        self.store, self.key = store, f"convoy/checkpoint/model-rank{rank}"

    def committed_step(self) -> int:
        if not self.store.check([self.key]):
            return -1
        return int(self.store.get(self.key))

    def describe(self) -> str:
        return f"the model file of {self.key.rsplit('-', 1)[1]}"

    @staticmethod
    def publish(store: Any, rank: int, step: int) -> None:
        """Tell the other machines' writers that ``rank``'s model file holds ``step``."""
        store.set(f"convoy/checkpoint/model-rank{rank}", str(step))


class PeerFile:
    """Another rank's checkpoint file, polled for its newest committed step.

    The file stays open between polls (opening one reads the mount table and
    parses its layout), and is opened afresh when it was replaced (a rank
    file is created anew when its layout changes).
    """

    def __init__(self, path: Path):
        self.path = path
        self._store: Store | None = None
        self._inode = -1

    def committed_step(self) -> int:
        try:
            inode = os.stat(self.path).st_ino
            if inode != self._inode:
                self.close()
                self._store, self._inode = Store.open(self.path), inode
        except (OSError, FormatError):
            self.close()
            return -1
        newest = -1
        for area in range(AREAS):
            try:
                record = self._store.record(area)
            except FormatError:
                continue
            chain = read_chain(log_path(self.path, area), record.generation, record.step)
            newest = max(newest, chain[-1].step if chain else record.step)
        return newest

    def describe(self) -> str:
        return str(self.path)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store, self._inode = None, -1
