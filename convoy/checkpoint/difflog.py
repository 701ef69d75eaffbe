"""Differential checkpoints: after a full snapshot, each step's averaged update, appended to a log.

With gradient compression the update a step applies is sparse (the blocks
the ranks exchanged). Writing it, a few hundred KB, instead of every layer's
parameters and optimizer state is what lets a checkpoint be taken every step
for little: a full snapshot every K steps, and between them one record per
step. Recovery restores the snapshot and replays the records through the
same optimizer arithmetic, so the state is bit-identical.

Each area of the model file has its own log, next to it
(``model-rank0.ckpt.diffA``), that extends that area's snapshot. The log's
header names the snapshot's generation and step; a record is
``magic, step, payload length, payload CRC-32`` then the payload, the magic
written last, so a record cut short by a crash is no record. The log of an
area is emptied when a new snapshot starts in that area.

Example::

    >>> log = DiffLog.start(path, generation=4, base_step=40)
    >>> log.append(41, payload)
    >>> [entry.step for entry in read_chain(path, 4, 40)]
    [41]
"""
from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convoy.checkpoint import faults
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.store import AREA_NAMES
from convoy.utils.atomic import sync_folder

_LOG_HEAD = struct.Struct("<8sQQ")      # magic, base generation, base step
_RECORD_HEAD = struct.Struct("<8sQQI")  # magic, step, payload length, payload crc32
LOG_MAGIC = b"CVDIFFLG"
RECORD_MAGIC = b"CVDIFFRC"


def log_path(model_path: Path, area: int) -> Path:
    return model_path.with_name(f"{model_path.name}.diff{AREA_NAMES[area]}")


@dataclass
class Entry:
    """One record of a log: the step count after it, and where its payload lies."""

    step: int
    offset: int
    length: int
    checksum: int


class DiffLog:
    """An open log, appended to by the writer's persister thread."""

    def __init__(self, path: Path, fd: int, end: int):
        self.path, self._fd, self.end = path, fd, end

    @classmethod
    def start(cls, path: Path, generation: int, base_step: int) -> "DiffLog":
        """Empty ``path`` and give it a header: the log of the snapshot ``generation`` at ``base_step``."""
        fresh = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _LOG_HEAD.pack(LOG_MAGIC, generation, base_step), 0)
        os.fdatasync(fd)
        if fresh:
            sync_folder(path.parent)
        return cls(path, fd, _LOG_HEAD.size)

    @classmethod
    def reopen(cls, path: Path, generation: int, base_step: int, through_step: int) -> "DiffLog":
        """Open the log of snapshot ``generation`` and drop its records after ``through_step``."""
        chain = [e for e in read_chain(path, generation, base_step, verify=True) if e.step <= through_step]
        fd = os.open(path, os.O_RDWR)
        end = chain[-1].offset + chain[-1].length if chain else _LOG_HEAD.size
        os.ftruncate(fd, end)
        os.fdatasync(fd)
        return cls(path, fd, end)

    def append(self, step: int, payload: bytes) -> None:
        """Add the record of ``step`` and make it durable; the magic goes last."""
        head = _RECORD_HEAD.pack(RECORD_MAGIC, step, len(payload), zlib.crc32(payload))
        os.pwrite(self._fd, head[8:] + payload, self.end + 8)
        faults.halfway("update", step)
        os.pwrite(self._fd, head[:8], self.end)
        os.fdatasync(self._fd)
        self.end += len(head) + len(payload)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_chain(path: Path, generation: int, base_step: int, verify: bool = False) -> list[Entry]:
    """The records of ``path`` that extend snapshot ``generation`` step by step from ``base_step``.

    The chain ends at the first missing, torn or (``verify``) damaged record,
    or at a step that does not follow the one before. A missing log, or one of
    another snapshot, is an empty chain.
    """
    try:
        with open(path, "rb") as f:
            data = f.read() if verify else None
            head = data[:_LOG_HEAD.size] if data is not None else f.read(_LOG_HEAD.size)
            if len(head) < _LOG_HEAD.size or _LOG_HEAD.unpack(head) != (LOG_MAGIC, generation, base_step):
                return []
            chain, offset = [], _LOG_HEAD.size
            while True:
                if data is not None:
                    raw = data[offset:offset + _RECORD_HEAD.size]
                else:
                    f.seek(offset)
                    raw = f.read(_RECORD_HEAD.size)
                if len(raw) < _RECORD_HEAD.size:
                    return chain
                magic, step, length, checksum = _RECORD_HEAD.unpack(raw)
                start = offset + _RECORD_HEAD.size
                if magic != RECORD_MAGIC or step != base_step + len(chain) + 1:
                    return chain
                if data is not None and (start + length > len(data)
                                         or zlib.crc32(data[start:start + length]) != checksum):
                    return chain
                chain.append(Entry(step, start, length, checksum))
                offset = start + length
    except OSError:
        return []


def read_payload(path: Path, entry: Entry) -> dict[str, Any]:
    """The update of one record, its checksum checked; FormatError when damaged."""
    with open(path, "rb") as f:
        f.seek(entry.offset)
        raw = f.read(entry.length)
    if len(raw) != entry.length or zlib.crc32(raw) != entry.checksum:
        raise FormatError(f"{path.name}: the record of step {entry.step} is damaged (checksum mismatch)")
    return torch.load(io.BytesIO(raw), weights_only=True)


# ------------------------------------------------------------------ the update
def sparse(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, values)`` of the non-zero elements of ``grad``, -0.0 included (bit-exact)."""
    flat = grad.detach().reshape(-1)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    index = torch.nonzero(bits).view(-1)
    positions = index.to(torch.int32) if flat.numel() < 2 ** 31 else index
    return positions, flat[index]


def dense(positions: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient ``sparse`` encoded, shaped like ``like``."""
    out = torch.zeros(like.numel(), dtype=values.dtype)
    out[positions.long()] = values
    return out.view_as(like)


def pack(update: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(update, buffer)
    return buffer.getvalue()
