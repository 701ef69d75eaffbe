"""Gradient compressors behind one interface (GRACE's layering).

Each compressor's module registers a :class:`CompressorSpec` when it is
imported (:mod:`convoy.compress.registry`); everything that names compressors
reads :func:`compressor_names` and :func:`build_compressor`.
"""
from __future__ import annotations

from convoy.compress.base import Compressor, LayerInfo, Memory, NoMemory, Place, ResidualMemory, Support
from convoy.compress.registry import (CompressorSpec, build_compressor, compressor_names, compressor_spec,
                                      momentum_corrected_names, register, sparse_names, unregister)

# isort: off
# The compressors, imported in the order their names are listed (registration order).
from convoy.compress.identity import IdentityCompressor
from convoy.compress.fp16 import FP16Compressor
from convoy.compress.blocktopk import (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_PER_LAYER, DEFAULT_DENSE_BELOW,
                                      DEFAULT_METRIC, DEFAULT_SELECTION, SELECTIONS, BlockTopKCompressor)
from convoy.compress.topk import DEFAULT_ELEMENT_FRACTION, TopKCompressor
from convoy.compress.randomk import RandomKCompressor
from convoy.compress.powersgd import DEFAULT_RANK as DEFAULT_POWERSGD_RANK
from convoy.compress.powersgd import PowerSGDCompressor
# isort: on
from convoy.compress.blocks import METRICS, BlockLayout
from convoy.compress.momentum import MomentumCorrection
from convoy.compress.rle import CodecError

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_BLOCKS_PER_LAYER", "DEFAULT_DENSE_BELOW", "DEFAULT_ELEMENT_FRACTION",
           "DEFAULT_METRIC", "DEFAULT_POWERSGD_RANK", "DEFAULT_SELECTION", "METRICS", "SELECTIONS", "BlockLayout",
           "BlockTopKCompressor", "CodecError", "Compressor", "CompressorSpec", "FP16Compressor",
           "IdentityCompressor", "LayerInfo", "Memory", "MomentumCorrection", "NoMemory", "Place",
           "PowerSGDCompressor", "RandomKCompressor", "ResidualMemory", "Support", "TopKCompressor",
           "build_compressor", "compressor_names", "compressor_spec", "momentum_corrected_names", "register",
           "sparse_names", "unregister"]
