"""Parsing the IDX file format that MNIST ships in."""
from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from convoy.errors import UsageError

# The magic number is 0x0000 | type code | number of dimensions; 0x08 is unsigned byte.
_UINT8 = 0x08


def uint8_magic(ndims: int) -> int:
    """The IDX magic number of a uint8 array with ``ndims`` dimensions."""
    return (_UINT8 << 8) | ndims


def parse_uint8_idx(data: bytes, path: Path, ndims: int, what: str) -> np.ndarray:
    """Decode an IDX file holding a uint8 array of ``ndims`` dimensions.

    Args:
        data: the whole (decompressed) file.
        path: the file, for error messages.
        ndims: the number of dimensions the caller expects.
        what: a description of the expected content, e.g. ``"uint8 images, 3 dims"``.

    Raises:
        UsageError: wrong magic number, short header, or a data length that
            disagrees with the header's dimensions.
    """
    expected = uint8_magic(ndims)
    header_size = 4 + 4 * ndims
    if len(data) < 4:
        raise UsageError(f"{path}: too short for an IDX file ({len(data)} bytes); expected {what}")
    (magic,) = struct.unpack(">i", data[:4])
    if magic != expected:
        raise UsageError(f"{path}: expected IDX magic 0x{expected:08x} ({what}), found 0x{magic & 0xFFFFFFFF:08x}")
    if len(data) < header_size:
        raise UsageError(f"{path}: truncated header: {ndims} dims need {header_size} bytes, file has {len(data)}")
    dims = struct.unpack(f">{ndims}i", data[4:header_size])
    needed = math.prod(dims)
    present = len(data) - header_size
    if present != needed:
        problem = "truncated" if present < needed else "trailing data"
        shape = "x".join(map(str, dims))
        raise UsageError(
            f"{path}: {problem}: header says {shape} = {needed} bytes of data, file has {present}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(dims)
