"""Gradient compressors behind one interface (GRACE's layering)."""
from __future__ import annotations

from convoy.compress.base import Compressor, LayerInfo, Memory, NoMemory, ResidualMemory, Support
from convoy.compress.blocktopk import (DEFAULT_BLOCK_SIZE, DEFAULT_DENSE_BELOW, DEFAULT_METRIC, SELECTIONS,
                                      BlockTopKCompressor)
from convoy.compress.blocks import METRICS, BlockLayout
from convoy.compress.fp16 import FP16Compressor
from convoy.compress.identity import IdentityCompressor
from convoy.compress.momentum import MomentumCorrection
from convoy.compress.powersgd import DEFAULT_RANK as DEFAULT_POWERSGD_RANK
from convoy.compress.powersgd import PowerSGDCompressor
from convoy.compress.randomk import RandomKCompressor
from convoy.compress.rle import CodecError
from convoy.compress.topk import TopKCompressor
from convoy.errors import UsageError

COMPRESS_NAMES = ("none", "fp16", "blocktopk", "topk", "randomk", "powersgd")
# The compressors that send a share of each layer (momentum correction with masking).
SPARSE_NAMES = ("blocktopk", "topk", "randomk")
# The compressors momentum correction applies to: the sparse ones, and low rank (without masking).
MOMENTUM_CORRECTED_NAMES = (*SPARSE_NAMES, "powersgd")


def build_compressor(name: str, *, blocks_per_layer: int | None = None, block_fraction: float | None = None,
                     block_metric: str = DEFAULT_METRIC, block_selection: str = "local",
                     block_size: int | None = DEFAULT_BLOCK_SIZE, element_fraction: float = 0.01,
                     powersgd_rank: int = DEFAULT_POWERSGD_RANK,
                     dense_below: int = DEFAULT_DENSE_BELOW) -> tuple[Compressor, Memory]:
    """Return the compressor called ``name`` and the error-feedback memory it uses.

    Args:
        name: one of ``COMPRESS_NAMES``.
        blocks_per_layer, block_fraction, block_metric, block_selection, block_size, dense_below:
            blocktopk's settings (see :class:`BlockTopKCompressor`); the others ignore them.
        element_fraction: share of elements that topk and randomk send.
        powersgd_rank: columns of powersgd's factors.

    Example::

        >>> compressor, memory = build_compressor("blocktopk", block_fraction=0.01)
    """
    if name == "none":
        return IdentityCompressor(), NoMemory()
    if name == "fp16":
        return FP16Compressor(), ResidualMemory()
    if name == "blocktopk":
        return (BlockTopKCompressor(blocks_per_layer, block_fraction, block_metric, block_selection, block_size,
                                    dense_below), ResidualMemory())
    if name == "topk":
        return TopKCompressor(element_fraction), ResidualMemory()
    if name == "randomk":
        return RandomKCompressor(element_fraction), ResidualMemory()
    if name == "powersgd":
        return PowerSGDCompressor(powersgd_rank), ResidualMemory()
    raise UsageError(f"unknown compressor {name!r}; choose one of: {', '.join(COMPRESS_NAMES)}")


__all__ = ["COMPRESS_NAMES", "DEFAULT_BLOCK_SIZE", "DEFAULT_DENSE_BELOW", "DEFAULT_METRIC",
           "DEFAULT_POWERSGD_RANK", "METRICS", "MOMENTUM_CORRECTED_NAMES", "SELECTIONS", "SPARSE_NAMES", "BlockLayout",
           "BlockTopKCompressor", "CodecError", "Compressor", "FP16Compressor", "IdentityCompressor", "LayerInfo",
           "Memory", "MomentumCorrection", "NoMemory", "PowerSGDCompressor",
           "RandomKCompressor", "ResidualMemory", "Support", "TopKCompressor", "build_compressor"]
