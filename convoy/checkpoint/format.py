"""The on-disk layout of a checkpoint file: fixed offsets, raw bytes, commit records.

A file is a superblock followed by two areas of equal size. The superblock
holds the layout (every slot, and every tensor's dtype, shape and offset inside
its slot) as JSON, written once when the file is created. An area is a commit
record region followed by the slots, each page-aligned so it can be flushed
on its own. Tensors are stored as their raw bytes at fixed offsets: writing a
checkpoint is a memory copy, reading one is a view (no pickling).

Example::

    >>> layout = Layout("model", [Slot("conv1", [TensorSpec("param.weight", "float32", [6, 1, 5, 5])])])
    >>> layout.area_size() % PAGE
    0
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

MAGIC = b"CONVOYCK"
RECORD_MAGIC = b"CVCOMMIT"
VERSION = 1
PAGE = 4096
# The commit record region at the start of each area: the fixed part, one
# checksum per slot, and a small JSON of per-step facts (RNG states, hyper-parameters).
RECORD_BYTES = 64 * 1024
_SUPER_HEAD = struct.Struct("<8sIIQ")          # magic, version, json length, json crc32
_RECORD_HEAD = struct.Struct("<8sIQQQQII")     # magic, version, generation, step, epoch, position, slots, json length


class FormatError(ValueError):
    """A file or record that is not a valid convoy checkpoint (damaged, foreign, or another version)."""


def align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


@dataclass
class TensorSpec:
    """One tensor inside a slot: its key, dtype name and shape; ``offset``: where the layout placed it."""

    key: str
    dtype: str
    shape: list[int]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty(0, dtype=dtype_of(self.dtype)).element_size()

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(key, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))


@dataclass
class Slot:
    """A unit that is snapshotted, persisted and checksummed together (one layer, or one rank's state)."""

    name: str
    tensors: list[TensorSpec]
    offset: int = 0      # from the start of an area
    nbytes: int = 0

    def spec(self) -> list[tuple[str, str, list[int]]]:
        return [(t.key, t.dtype, t.shape) for t in self.tensors]


@dataclass
class Layout:
    """Every slot of a file at its fixed offset; ``kind`` is ``"model"`` or ``"rank"``."""

    kind: str
    slots: list[Slot]
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The slots given, each placed at its offset (copies: the layout owns its slots).
        offset, placed = RECORD_BYTES, []
        for slot in self.slots:
            inner, tensors = 0, []
            for t in slot.tensors:
                tensors.append(replace(t, offset=inner))
                inner += align(t.nbytes, 64)   # aligned so every tensor view is aligned
            placed.append(replace(slot, tensors=tensors, offset=offset, nbytes=inner))
            offset = align(offset + max(inner, 1))
        self.slots = placed
        self._area = offset
        if 4 * len(self.slots) + _RECORD_HEAD.size + 4096 > RECORD_BYTES:
            raise ValueError(f"{len(self.slots)} slots do not fit in a commit record")

    def area_size(self) -> int:
        return self._area

    @property
    def checksum(self) -> str:
        """The name of the function that checks this file's slots (``CHECKSUMS``); files
        written before there was a choice say nothing and use CRC-32."""
        return self.info.get("checksum", "crc32")

    def signature(self) -> str:
        """A hash of the names, dtypes and shapes: equal signatures mean the same model."""
        text = json.dumps([[s.name, s.spec()] for s in self.slots])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def first_mismatch(self, other: "Layout") -> str | None:
        """A sentence naming the first slot that differs from ``other``, or ``None``."""
        for mine, theirs in zip(self.slots, other.slots):
            if mine.name != theirs.name:
                return f"layer {theirs.name!r} where this model has {mine.name!r}"
            if mine.spec() != theirs.spec():
                return (f"layer {mine.name!r} differs: checkpoint has {_brief(theirs)}, "
                        f"this model has {_brief(mine)}")
        if len(self.slots) != len(other.slots):
            return f"{len(other.slots)} layers in the checkpoint, {len(self.slots)} in this model"
        return None

    def to_json(self) -> bytes:
        return json.dumps({"kind": self.kind, "info": self.info,
                           "slots": [{"name": s.name, "tensors": [asdict(t) for t in s.tensors]}
                                     for s in self.slots]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Layout":
        data = json.loads(raw)
        slots = [Slot(s["name"], [TensorSpec(t["key"], t["dtype"], t["shape"]) for t in s["tensors"]])
                 for s in data["slots"]]
        return cls(data["kind"], slots, data.get("info", {}))


def pagesum(data: bytes | memoryview) -> int:
    """A 32-bit check of ``data`` (a multiple of 8 bytes) that costs one vectorised pass.

    ``data`` is read as 64-bit words, summed per 4 KiB page; the check folds
    (with CRC-32) the sum of the pages' sums and their sum weighted by page
    number, both modulo 2^64. Any changed word, and any page lost, stale or
    written in another page's place, changes it (bar a 2^-32 fold collision).
    Unlike CRC-32 it misses changes that cancel within a page (the same bit
    flipped up in one word and down in another): it is for slots whose
    completeness the commit protocol already guarantees, and which are too
    large to run CRC-32 over every step (a rank's error-feedback residuals).
    """
    return fold_page_sums(page_sums(data))


def page_sums(data: bytes | memoryview, out: np.ndarray | None = None) -> np.ndarray:
    """The sum modulo 2^64 of each 4 KiB page of ``data`` (a multiple of 8 bytes; a last,
    partial page counts as if padded with zeros), into ``out`` when given."""
    words = np.frombuffer(data, dtype=np.uint64)
    whole = len(words) - len(words) % _PAGE_WORDS
    pages = -(-len(words) // _PAGE_WORDS)
    sums = np.empty(pages, dtype=np.uint64) if out is None else out[:pages]
    words[:whole].reshape(-1, _PAGE_WORDS).sum(axis=1, dtype=np.uint64, out=sums[:whole // _PAGE_WORDS])
    if whole < len(words):
        sums[-1] = words[whole:].sum(dtype=np.uint64)
    return sums


def fold_page_sums(sums: np.ndarray) -> int:
    """:func:`pagesum` of the data whose :func:`page_sums` are ``sums``."""
    weighted = sums * np.arange(1, len(sums) + 1, dtype=np.uint64)
    return zlib.crc32(struct.pack("<QQ", int(sums.sum(dtype=np.uint64)), int(weighted.sum(dtype=np.uint64))))


_PAGE_WORDS = PAGE // 8
CHECKSUMS: dict[str, Callable[[bytes | memoryview], int]] = {"crc32": zlib.crc32, "pagesum": pagesum}


def checksum_function(name: str) -> Callable[[bytes | memoryview], int]:
    """The checksum a layout names; FormatError for one this convoy does not know."""
    try:
        return CHECKSUMS[name]
    except KeyError:
        raise FormatError(f"unknown slot checksum {name!r}") from None


def _brief(slot: Slot) -> str:
    return ", ".join(f"{k} {d}{tuple(s)}" for k, d, s in slot.spec()) or "no tensors"


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"unknown dtype {name!r}")
    return dtype


def pack_superblock(layout: Layout) -> bytes:
    """The superblock: a fixed head and the layout JSON, padded to whole pages."""
    raw = layout.to_json()
    head = _SUPER_HEAD.pack(MAGIC, VERSION, len(raw), zlib.crc32(raw))
    data = head + raw
    return data + b"\0" * (align(len(data)) - len(data))


def unpack_superblock(head: bytes, read: Any) -> tuple[Layout, int]:
    """Parse the superblock from its first bytes ``head``; ``read(offset, n)`` reads more. Returns (layout, size)."""
    if len(head) < _SUPER_HEAD.size:
        raise FormatError("the file is shorter than a checkpoint header")
    magic, version, length, crc = _SUPER_HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FormatError("not a convoy checkpoint file (bad magic)")
    if version != VERSION:
        raise FormatError(f"checkpoint format version {version}; this convoy reads version {VERSION}")
    raw = read(_SUPER_HEAD.size, length)
    if len(raw) != length or zlib.crc32(raw) != crc:
        raise FormatError("the checkpoint header is damaged (checksum mismatch)")
    return Layout.from_json(raw), align(_SUPER_HEAD.size + length)


@dataclass
class CommitRecord:
    """Written last, once every slot of a step is persisted: the step is then recoverable.

    ``step`` counts the steps done (resume runs step ``step`` next); ``generation``
    counts commits and picks the area (``generation % 2``); ``checksums`` are the
    CRC-32 of each slot's bytes; ``extra`` is small JSON (signature, RNG, hyper-parameters).
    """

    generation: int
    step: int
    epoch: int
    position: int
    checksums: list[int]
    extra: dict[str, Any] = field(default_factory=dict)

    def pack(self) -> bytes:
        raw = json.dumps(self.extra).encode()
        body = (_RECORD_HEAD.pack(RECORD_MAGIC, VERSION, self.generation, self.step, self.epoch,
                                  self.position, len(self.checksums), len(raw))
                + struct.pack(f"<{len(self.checksums)}I", *self.checksums) + raw)
        if len(body) + 4 > RECORD_BYTES:
            raise ValueError(f"commit record of {len(body)} bytes exceeds {RECORD_BYTES}")
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "CommitRecord":
        """Parse and verify a record; raise FormatError when it is empty, torn or damaged."""
        data = bytes(data[:RECORD_BYTES])
        magic, version, gen, step, epoch, pos, n, length = _RECORD_HEAD.unpack_from(data)
        if magic != RECORD_MAGIC:
            raise FormatError("no commit record (never committed, or being rewritten)")
        end = _RECORD_HEAD.size + 4 * n + length
        if version != VERSION or end + 4 > len(data):
            raise FormatError("commit record is damaged (bad size or version)")
        (crc,) = struct.unpack_from("<I", data, end)
        if zlib.crc32(data[:end]) != crc:
            raise FormatError("commit record is damaged (checksum mismatch)")
        checksums = list(struct.unpack_from(f"<{n}I", data, _RECORD_HEAD.size))
        extra = json.loads(data[_RECORD_HEAD.size + 4 * n:end])
        return cls(gen, step, epoch, pos, checksums, extra)
