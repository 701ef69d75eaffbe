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
    >>> log.append(41, pack(41, [BucketUpdate(["fc"], {"lr": 0.1}, chunks_of(flat_grad))], skipped=[]))
    >>> [entry.step for entry in read_chain(path, 4, 40)]
    [41]
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.checkpoint import faults
from convoy.checkpoint.format import FormatError, dtype_of
from convoy.checkpoint.store import AREA_NAMES, raw_bytes, write_all
from convoy.compress import Support
from convoy.utils.atomic import sync_folder

_LOG_HEAD = struct.Struct("<8sQQ")      # magic, base generation, base step
_RECORD_HEAD = struct.Struct("<8sQQI")  # magic, step, payload length, payload crc32
LOG_MAGIC = b"CVDIFFL2"   # version 2: raw records (version 1 pickled them; its logs are ignored)
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
    def reopen(cls, path: Path, generation: int, base_step: int, through_step: int,
               chain: list[Entry] | None = None, verify: bool = True) -> "DiffLog":
        """Open the log of snapshot ``generation`` and drop its records after ``through_step``.

        Args:
            chain: the log's records up to ``through_step`` as :func:`read_chain` gave them, when the
                caller has just read them (a resume's restore point): the log is not read again.
            verify: check the records' checksums to find where the chain ends (else only their
                heads are read: for a cut of records a caller verified before).
        """
        if chain is None:
            chain = read_chain(path, generation, base_step, verify=verify)
        chain = [e for e in chain if e.step <= through_step]
        fd = os.open(path, os.O_RDWR)
        end = chain[-1].offset + chain[-1].length if chain else _LOG_HEAD.size
        os.ftruncate(fd, end)
        os.fdatasync(fd)
        return cls(path, fd, end)

    def append(self, step: int, payload: list[memoryview]) -> int:
        """Add the record of ``step`` (its payload's buffers, in order) and make it durable; the
        magic goes last. Returns the record's bytes."""
        length, checksum = 0, 0
        for part in payload:
            length += len(part)
            checksum = zlib.crc32(part, checksum)
        head = _RECORD_HEAD.pack(RECORD_MAGIC, step, length, checksum)
        write_all(self._fd, [memoryview(head)[8:], *payload], self.end + 8)
        faults.halfway("update", step)
        os.pwrite(self._fd, head[:8], self.end)
        os.fdatasync(self._fd)
        self.end += len(head) + length
        return len(head) + length

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
            fd = f.fileno()
            head = os.pread(fd, _LOG_HEAD.size, 0)
            if len(head) < _LOG_HEAD.size or _LOG_HEAD.unpack(head) != (LOG_MAGIC, generation, base_step):
                return []
            # A log may hold hundreds of MB: a record at a time is checked, in one buffer (never the whole
            # file in memory; nor mapped: a live job's writer may cut the log while it is inspected).
            chain, offset, buffer = [], _LOG_HEAD.size, bytearray()
            while True:
                raw = os.pread(fd, _RECORD_HEAD.size, offset)
                if len(raw) < _RECORD_HEAD.size:
                    return chain
                magic, step, length, checksum = _RECORD_HEAD.unpack(raw)
                start = offset + _RECORD_HEAD.size
                if magic != RECORD_MAGIC or step != base_step + len(chain) + 1:
                    return chain
                if verify:
                    if len(buffer) < length:
                        buffer = bytearray(length)
                    view = memoryview(buffer)[:length]
                    if os.preadv(fd, [view], start) != length or zlib.crc32(view) != checksum:
                        return chain
                chain.append(Entry(step, start, length, checksum))
                offset = start + length
    except OSError:
        return []


def read_payload(path: Path, entry: Entry) -> dict[str, Any]:
    """The update of one record (see :func:`unpack`), its checksum checked; FormatError when damaged."""
    raw = bytearray(entry.length)   # the tensors of the update are views of it: read once, no copy
    with open(path, "rb") as f:
        f.seek(entry.offset)
        got = f.readinto(raw)
    if got != entry.length or zlib.crc32(raw) != entry.checksum:
        raise FormatError(f"{path.name}: the record of step {entry.step} is damaged (checksum mismatch)")
    return unpack(raw)


# ------------------------------------------------------------------ the update
CHUNK = 64   # elements per run of a gradient that a record keeps or drops as a whole
_HEAD = struct.Struct("<I")   # the JSON header's length, at the start of a payload
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Chunks:
    """A gradient as its runs of ``run`` elements that hold a non-zero bit (-0.0 included).

    ``chunks`` are the runs' indices (int32), ``rows`` their values
    (``len(chunks) x run``) and ``tail`` the last ``numel % run`` elements,
    kept whatever they are. Block-sparse updates (whole filters, rows) fill
    runs of ``CHUNK``: finding them is one min/max pass over the gradient's
    bits, much cheaper than finding every non-zero element, and no dense copy.
    Scattered elements (element-wise top-k) are runs of 1.
    """

    chunks: torch.Tensor
    rows: torch.Tensor
    tail: torch.Tensor
    numel: int
    run: int = CHUNK

    def tensors(self) -> list[torch.Tensor]:
        return [self.chunks, self.rows, self.tail]


def chunks_of(grad: torch.Tensor, support: Support | None = None) -> Chunks:
    """The non-zero runs of ``grad``: copies of them, so ``grad`` may change afterwards.

    ``support``: where ``grad`` may be non-zero (every element outside is ``+0.0``), as an
    exchange of sparse blocks knows; then only the runs it touches are kept, with no pass
    over the gradient (they may hold zeros: the record is exact either way).
    """
    flat = grad.detach().reshape(-1)
    full = flat.numel() // CHUNK
    head = flat[:full * CHUNK]
    if support is not None:
        index = _runs_touched(support, full).to(flat.device)
    else:
        index = _non_zero_runs(head, full)
        if len(index) * 8 > full and flat.numel() < 2 ** 31:
            # Many runs hold something: scattered elements (element-wise top-k) may be fewer bytes
            # as positions and values; a dense update (low rank) is not.
            # Counted first (one pass, nothing allocated): a dense update's positions are never kept.
            size, bits = flat.element_size(), flat.view(_BITS[flat.element_size()])
            if int(torch.count_nonzero(bits)) * (4 + size) < len(index) * CHUNK * size:
                positions = torch.nonzero(bits).view(-1)
                return Chunks(positions.to(torch.int32), flat[positions].view(-1, 1), flat[:0].clone(),
                              flat.numel(), 1)
    return Chunks(index.to(torch.int32), head.view(full, CHUNK).index_select(0, index),
                  flat[full * CHUNK:].clone(), flat.numel())


def _non_zero_runs(head: torch.Tensor, full: int) -> torch.Tensor:
    """The indices of the ``full`` runs of ``head`` that hold a non-zero bit: one min/max pass."""
    if not full:
        return torch.zeros(0, dtype=torch.long, device=head.device)
    bits = head.view(_BITS[head.element_size()])
    if head.element_size() == 4 and bits.storage_offset() % 2 == 0:
        bits = bits.view(torch.int64)   # two elements a word: half the reduction's work
    low, high = torch.aminmax(bits.view(full, -1), dim=1)   # a run is zero iff its bits' min and max are
    return torch.nonzero(low.ne(0).logical_or_(high.ne(0))).view(-1)


def _runs_touched(support: Support, full: int) -> torch.Tensor:
    """The sorted indices of the ``full`` runs that ``support``'s element ranges touch."""
    starts, lengths = support.ranges()
    first = starts // CHUNK
    counts = (starts + lengths - 1) // CHUNK - first + 1
    ends = np.cumsum(counts)
    runs = np.repeat(first - (ends - counts), counts) + np.arange(ends[-1] if len(ends) else 0)
    return torch.from_numpy(np.unique(runs[runs < full]))   # sorted; the tail past the full runs is kept whole


def dense(encoded: Chunks) -> torch.Tensor:
    """The flat gradient ``chunks_of`` encoded."""
    out = torch.zeros(encoded.numel, dtype=encoded.rows.dtype)
    run = encoded.run
    full = out.numel() // run
    if len(encoded.tail) != out.numel() - full * run:
        raise FormatError(f"a record's run tail of {len(encoded.tail)} values does not fit {encoded.numel}")
    out[:full * run].view(full, run).index_copy_(0, encoded.chunks.long(), encoded.rows)
    out[full * run:] = encoded.tail
    return out


@dataclass
class BucketUpdate:
    """The update a step applied to layers updated together: their names (their gradients'
    order in ``grad``), the optimizer's hyper-parameters, and the flat averaged gradient."""

    layers: list[str]
    hyper: dict[str, Any]
    grad: Chunks


def pack(step: int, buckets: list[BucketUpdate], skipped: list[str]) -> list[memoryview]:
    """A record's payload as buffers to write in turn (no joined copy, no pickle): a JSON
    header (each bucket's layers, hyper-parameters and tensor sizes; the layers whose update
    the step skipped), then the tensors' raw bytes."""
    header = {"step": step, "skipped": skipped,
              "buckets": [[b.layers, b.hyper, b.grad.numel, str(b.grad.rows.dtype).removeprefix("torch."),
                           b.grad.run, len(b.grad.chunks), len(b.grad.tail)] for b in buckets]}
    raw = json.dumps(header).encode()
    return [memoryview(_HEAD.pack(len(raw)) + raw), *(raw_bytes(t) for b in buckets for t in b.grad.tensors())]


def unpack(raw: bytes | bytearray) -> dict[str, Any]:
    """``{"step", "buckets": [BucketUpdate], "skipped": [layer name]}`` from a payload (the
    tensors are views of ``raw`` when it is a bytearray, else of a copy)."""
    (length,) = _HEAD.unpack_from(raw)
    header = json.loads(raw[_HEAD.size:_HEAD.size + length])
    offset = _HEAD.size + length
    buffer = raw if isinstance(raw, bytearray) else bytearray(raw)   # writable: the tensors below are views of it

    def take(dtype: torch.dtype, count: int) -> torch.Tensor:
        nonlocal offset
        size = count * torch.empty(0, dtype=dtype).element_size()
        if offset + size > len(buffer):
            raise FormatError("a differential record is shorter than its header says")
        out = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset) if count else \
            torch.empty(0, dtype=dtype)
        offset += size
        return out

    buckets = []
    for layers, hyper, numel, dtype_name, run, count, tail in header["buckets"]:
        dtype = dtype_of(dtype_name)
        chunks = take(torch.int32, count)
        grad = Chunks(chunks, take(dtype, count * run).view(count, run), take(dtype, tail), numel, run)
        buckets.append(BucketUpdate(layers, hyper, grad))
    return {"step": header["step"], "buckets": buckets, "skipped": header["skipped"]}
