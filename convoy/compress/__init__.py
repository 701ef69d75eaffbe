"""Gradient compressors behind one interface (GRACE's layering)."""
from __future__ import annotations

from convoy.compress.base import Compressor, Memory, NoMemory, ResidualMemory
from convoy.compress.fp16 import FP16Compressor
from convoy.compress.identity import IdentityCompressor
from convoy.errors import UsageError

COMPRESS_NAMES = ("none", "fp16")


def build_compressor(name: str) -> tuple[Compressor, Memory]:
    """Return the compressor called ``name`` and the error-feedback memory it uses."""
    if name == "none":
        return IdentityCompressor(), NoMemory()
    if name == "fp16":
        return FP16Compressor(), ResidualMemory()
    raise UsageError(f"unknown compressor {name!r}; choose one of: {', '.join(COMPRESS_NAMES)}")


__all__ = ["COMPRESS_NAMES", "Compressor", "Memory", "NoMemory", "ResidualMemory",
           "IdentityCompressor", "FP16Compressor", "build_compressor"]
