"""Run-length coding of block-sparse gradients: a versioned, self-describing, checked byte format.

Layout (little-endian)::

    magic  b"CVRL"         4 bytes
    version                u8     (2)
    dtype code             u8     (see _DTYPES)
    segments               u16
    block size             u32    (0: each parameter cut along its first dimension)
    for each segment:
        ndim               u8
        shape              ndim x u32
        runs               u32
        runs x (skip u32, keep u32)   zero blocks skipped, then blocks kept
    values                 the kept blocks' raw values, segment after segment
    crc32                  u32 of every byte before it

A segment is one parameter cut into blocks (:mod:`convoy.compress.blocks`), so
the decoder rebuilds the block layout from the shapes and the block size alone. It rejects a
payload whose magic, version, dtype, runs, length or checksum do not add up,
and, when told which shapes to expect, one that describes other shapes: a
truncated or corrupt payload raises :class:`CodecError`, never decodes.
"""
from __future__ import annotations

import struct
import zlib
from typing import Sequence

import numpy as np
import torch

from convoy.compress.base import Support
from convoy.compress.blocks import BlockLayout

MAGIC = b"CVRL"
VERSION = 2
_HEAD = struct.Struct("<4sBBHI")
_U8, _U32 = struct.Struct("<B"), struct.Struct("<I")
_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CodecError(ValueError):
    """A payload that is not a well-formed encoding (truncated, corrupt, or of other shapes)."""


def runs(kept: torch.Tensor) -> np.ndarray:
    """``(skip, keep)`` pairs of sorted, distinct block indices, as a ``(runs, 2)`` uint32 array.

    Example::

        >>> runs(torch.tensor([2, 3, 7])).tolist()
        [[2, 2], [3, 1]]
    """
    idx = kept.cpu().numpy().astype(np.int64)
    if idx.size == 0:
        return np.zeros((0, 2), dtype="<u4")
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = idx[np.concatenate(([0], breaks))]
    ends = idx[np.concatenate((breaks - 1, [idx.size - 1]))] + 1
    skips = starts - np.concatenate(([0], ends[:-1]))
    return np.stack([skips, ends - starts], axis=1).astype("<u4")


def encode(flat: torch.Tensor, layout: BlockLayout, kept: Sequence[torch.Tensor]) -> torch.Tensor:
    """Encode the ``kept`` blocks (sorted indices per segment) of ``flat`` as a uint8 tensor.

    Example::

        >>> layout = BlockLayout([(2, 3)])
        >>> payload = encode(torch.arange(6.0), layout, [torch.tensor([1])])
        >>> decode(payload, layout.shapes).tolist()
        [0.0, 0.0, 0.0, 3.0, 4.0, 5.0]
    """
    if flat.dtype not in _CODES:
        raise ValueError(f"cannot encode {flat.dtype}; supported: {', '.join(map(str, _CODES))}")
    if len(layout.segments) > 0xFFFF:
        raise ValueError(f"at most 65535 segments, got {len(layout.segments)}")
    head = [_HEAD.pack(MAGIC, VERSION, _CODES[flat.dtype], len(layout.segments), layout.block_size or 0)]
    for segment, idx in zip(layout.segments, kept):
        pairs = runs(idx)
        head += [_U8.pack(len(segment.shape)), np.asarray(segment.shape, dtype="<u4").tobytes(),
                 _U32.pack(len(pairs)), pairs.tobytes()]
    # The encoding is host bytes (its runs are coded on the CPU): a GPU gradient's kept values come over.
    values = layout.gather(flat, kept).cpu().contiguous().view(torch.uint8)
    body = torch.cat([torch.frombuffer(bytearray(b"".join(head)), dtype=torch.uint8), values])
    crc = zlib.crc32(body.numpy())
    return torch.cat([body, torch.frombuffer(bytearray(_U32.pack(crc)), dtype=torch.uint8)])


def max_encoded_bytes(layout: BlockLayout, counts: Sequence[int], dtype: torch.dtype) -> int:
    """The largest encoding of ``counts[i]`` kept blocks of each segment: one run per block."""
    size = _HEAD.size + _U32.size
    for segment, k in zip(layout.segments, counts):
        size += _U8.size + 4 * len(segment.shape) + _U32.size + 8 * k + k * segment.block_size * dtype.itemsize
    return size


class _Reader:
    """Bounds-checked reads from a byte buffer."""

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, fmt: struct.Struct) -> tuple:
        if self.pos + fmt.size > len(self.data):
            raise CodecError(f"payload truncated at byte {self.pos}")
        out = fmt.unpack_from(self.data, self.pos)
        self.pos += fmt.size
        return out

    def array(self, count: int) -> np.ndarray:
        end = self.pos + 4 * count
        if end > len(self.data):
            raise CodecError(f"payload truncated at byte {self.pos}")
        out = np.frombuffer(self.data[self.pos:end], dtype="<u4").astype(np.int64)
        self.pos = end
        return out


def decode(payload: torch.Tensor, expected_shapes: Sequence[Sequence[int]] | None = None,
           expected_block_size: int | None = None) -> torch.Tensor:
    """The dense flat tensor a payload from :func:`encode` describes.

    Args:
        payload: 1-D uint8 tensor, exactly one encoding.
        expected_shapes: if given, the parameter shapes the payload must describe.
        expected_block_size: with ``expected_shapes``, the block size it must
            use (``None``: rows).

    Raises:
        CodecError: the payload is truncated, corrupt, of an unknown version, or
            describes other shapes or blocks than expected.
    """
    layout, values, indices = _parse(payload, expected_shapes, expected_block_size)
    return layout.scatter(values, indices)


def decode_add(payload: torch.Tensor, out: torch.Tensor, expected_shapes: Sequence[Sequence[int]] | None = None,
               expected_block_size: int | None = None) -> torch.Tensor:
    """Add what :func:`decode` would return to ``out`` (flat, in place), touching only the kept blocks.

    Raises:
        CodecError: as :func:`decode`.
    """
    layout, values, indices = _parse(payload, expected_shapes, expected_block_size)
    return layout.scatter_add(values, indices, out)


def decode_sum(payloads: Sequence[torch.Tensor], expected_shapes: Sequence[Sequence[int]] | None = None,
               expected_block_size: int | None = None) -> tuple[torch.Tensor, Support]:
    """The sum of what :func:`decode` returns for each of ``payloads``, added in order, and the
    blocks they carry (zeros elsewhere), as found while decoding.

    Raises:
        CodecError: as :func:`decode`, for any of the payloads.
    """
    total, kept = None, []
    for payload in payloads:
        layout, values, indices = _parse(payload, expected_shapes, expected_block_size)
        total = layout.scatter(values, indices) if total is None else layout.scatter_add(values, indices, total)
        kept.append(indices)
    return total, layout.support(*kept)


def _parse(payload: torch.Tensor, expected_shapes: Sequence[Sequence[int]] | None,
           expected_block_size: int | None = None) -> tuple[BlockLayout, torch.Tensor, list[torch.Tensor]]:
    """``(layout, kept values, kept block indices per segment)`` of a checked payload."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")
    data = memoryview(payload.contiguous().numpy())
    if len(data) < _HEAD.size + _U32.size:
        raise CodecError(f"payload of {len(data)} bytes is shorter than a header")
    (crc,) = _U32.unpack_from(data, len(data) - _U32.size)
    body = data[:len(data) - _U32.size]
    if zlib.crc32(body) != crc:
        raise CodecError("payload checksum mismatch (corrupt or truncated)")
    reader = _Reader(body)
    magic, version, code, count, block_size = reader.take(_HEAD)
    if magic != MAGIC:
        raise CodecError(f"not a convoy run-length payload (magic {magic!r})")
    if version != VERSION:
        raise CodecError(f"payload version {version}; this convoy reads version {VERSION}")
    if code not in _DTYPES:
        raise CodecError(f"unknown dtype code {code}")
    shapes, kept = [], []
    for _ in range(count):
        (ndim,) = reader.take(_U8)
        shapes.append(tuple(reader.array(ndim).tolist()))
        (n,) = reader.take(_U32)
        kept.append(reader.array(2 * n).reshape(n, 2))
    if expected_shapes is not None and [tuple(s) for s in expected_shapes] != shapes:
        raise CodecError(f"payload describes shapes {shapes}, expected {[tuple(s) for s in expected_shapes]}")
    if expected_shapes is not None and block_size != (expected_block_size or 0):
        raise CodecError(f"payload cuts blocks of {block_size}, expected {expected_block_size or 0}")
    layout = BlockLayout(shapes, block_size or None)
    indices = [_indices(pairs, segment.blocks) for pairs, segment in zip(kept, layout.segments)]
    dtype = _DTYPES[code]
    expected_bytes = sum(i.numel() * s.block_size for i, s in zip(indices, layout.segments)) * dtype.itemsize
    raw = payload[reader.pos:len(body)]
    if raw.numel() != expected_bytes:
        raise CodecError(f"payload holds {raw.numel()} value bytes, its runs need {expected_bytes}")
    # clone: a slice at an odd byte offset cannot be viewed as wider values.
    return layout, raw.clone().view(dtype), indices


def _indices(pairs: np.ndarray, blocks: int) -> torch.Tensor:
    """Block indices of ``(skip, keep)`` runs, checked to stay inside ``blocks``."""
    if pairs.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    skips, keeps = pairs[:, 0], pairs[:, 1]
    if (keeps < 1).any() or (skips[1:] < 1).any():
        raise CodecError("malformed runs (empty run, or two kept runs touching)")
    ends = np.cumsum(skips + keeps)
    if ends[-1] > blocks:
        raise CodecError(f"runs cover {ends[-1]} blocks of a segment of {blocks}")
    starts = ends - keeps
    offsets = np.arange(keeps.sum()) - np.repeat(np.cumsum(keeps) - keeps, keeps)
    return torch.from_numpy(np.repeat(starts, keeps) + offsets)
