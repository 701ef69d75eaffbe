"""What a compressor puts on the wire for one layer.

Sizes come from the compressors' own arithmetic (``kept_count``,
``BlockLayout``, ``rle.max_encoded_bytes``, ``PowerSGDCompressor.payload_values``), so they match what
``convoy.sync.AllReduce`` sends byte for byte.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_DENSE_BELOW, DEFAULT_ELEMENT_FRACTION, DEFAULT_POWERSGD_RANK,
                             DEFAULT_SELECTION, compressor_spec)
from convoy.compress.blocks import BlockLayout
from convoy.compress.powersgd import PowerSGDCompressor
from convoy.compress.topk import kept_count
from convoy.errors import UsageError
from convoy.sync.pipeline import WARMUP_START_DENSITY

# The registered compressors (convoy.compress.compressor_names()) this module has a wire model of:
# the methods below are each one's own arithmetic, so a new compressor is modelled here by hand.
COMPRESSORS = ("none", "fp16", "randomk", "topk", "blocktopk", "powersgd")
# The density a sparse compressor's warm-up starts from: the pipeline's own.
RAMP_START = WARMUP_START_DENSITY

# convoy.sync.AllReduce's all-gather row starts with one int64 size per payload tensor.
_SIZE_HEADER = 8


@dataclass(frozen=True)
class Compression:
    """A compressor and its knobs, as ``convoy train`` takes them.

    Args:
        name: one of ``COMPRESSORS``.
        fraction: topk/randomk's ``--element-fraction``.
        blocks_per_layer, block_fraction: blocktopk's two ways of choosing how many blocks.
        selection: blocktopk's ``local`` (all-gathered) or ``global`` (all-reduced).
        block_size: blocktopk's ``--block-size`` (elements per block); None: whole rows and filters.
        rank: powersgd's ``--powersgd-rank``.
        dense_below: blocktopk's ``--dense-below`` (smaller parameters go whole).

    Example::

        >>> Compression("topk", fraction=0.01).payload(((1000, 100),))
        ('allgather', 8016)
    """

    name: str = "none"
    fraction: float = DEFAULT_ELEMENT_FRACTION
    blocks_per_layer: int | None = None
    block_fraction: float | None = None
    selection: str = DEFAULT_SELECTION
    block_size: int | None = DEFAULT_BLOCK_SIZE
    rank: int = DEFAULT_POWERSGD_RANK
    dense_below: int = DEFAULT_DENSE_BELOW

    def __post_init__(self) -> None:
        if self.name not in COMPRESSORS:
            compressor_spec(self.name)   # not registered: the registry's one line naming the compressors
            raise UsageError(f"the simulator has no model of compressor {self.name!r}; it models: "
                             f"{', '.join(COMPRESSORS)}")
        if not 0 < self.fraction <= 1 or (self.block_fraction is not None and not 0 < self.block_fraction <= 1):
            raise UsageError("compression fractions must be in (0, 1]")
        if (self.block_size is not None and self.block_size < 1) or self.rank < 1:
            raise UsageError("the block size and the powersgd rank must be >= 1")

    def payload(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[str, int]:
        """``(collective, bytes)`` of one layer: ``allreduce`` of a summable tensor or
        ``allgather`` of one row per rank. Global blocktopk's values are all-reduced
        once the ranks agreed on the blocks (:meth:`agreement`)."""
        numel = sum(numel_of(s) for s in shapes)
        if self.name == "none":
            return "allreduce", 4 * numel
        if self.name == "fp16":
            return "allreduce", 2 * numel
        if self.name == "randomk":
            return "allreduce", 4 * kept_count(numel, self.fraction)
        if self.name == "topk":
            return "allgather", 2 * _SIZE_HEADER + 8 * kept_count(numel, self.fraction)  # value + int32 index
        if self.name == "powersgd":   # the second round: Q and the layers sent dense
            return "allreduce", 4 * PowerSGDCompressor(self.rank).payload_values(shapes)[1]
        layout = BlockLayout(shapes, self.block_size, self.dense_below)
        # blocktopk's own default: one block per parameter.
        counts = layout.kept_counts(None if self.block_fraction is not None else (self.blocks_per_layer or 1),
                                    self.block_fraction)
        if self.selection == "global":
            return "allreduce", 4 * sum(k * s.block_size for k, s in zip(counts, layout.segments))
        from convoy.compress import rle
        import torch

        return "allgather", _SIZE_HEADER + rle.max_encoded_bytes(layout, counts, torch.float32)

    def agreement(self, shapes: tuple[tuple[int, ...], ...]) -> int:
        """Bytes of the all-reduce that must end before a layer's payload can be built
        (the auxiliary thread waits for it): global blocktopk's block scores, powersgd's
        first round (P); else 0."""
        if self.name == "powersgd":
            return 4 * PowerSGDCompressor(self.rank).payload_values(shapes)[0]
        if self.name != "blocktopk" or self.selection != "global":
            return 0
        return 4 * BlockLayout(shapes, self.block_size).total_blocks

    @property
    def density(self) -> float | None:
        """The share of each layer sent, for compressors whose warm-up ramps it down; else None."""
        if self.name in ("topk", "randomk"):
            return self.fraction
        return self.block_fraction if self.name == "blocktopk" else None

    def ramp_mean(self) -> "Compression":
        """This compression at the mean density of its warm-up ramp (25% decaying exponentially
        to its own), which a warm-up step costs on average; itself when it has no ramp."""
        target = self.density
        if target is None or target >= RAMP_START:
            return self
        mean = (RAMP_START - target) / math.log(RAMP_START / target)
        if self.name == "blocktopk":
            return replace(self, block_fraction=mean)
        return replace(self, fraction=mean)

    def label(self) -> str:
        if self.name in ("topk", "randomk"):
            return f"{self.name} {self.fraction:g}"
        if self.name == "blocktopk":
            kept = f"{self.block_fraction:g}" if self.block_fraction is not None else f"k={self.blocks_per_layer or 1}"
            size = "" if self.block_size == DEFAULT_BLOCK_SIZE else \
                (" rows" if self.block_size is None else f" block {self.block_size}")
            return f"blocktopk {kept}" + size + (" global" if self.selection == "global" else "")
        if self.name == "powersgd":
            return f"powersgd {self.rank}"
        return self.name

    def flags(self) -> list[str]:
        """The ``convoy train`` flags that select this compression."""
        if self.name == "none":
            return []
        flags = ["--compress", self.name]
        if self.name in ("topk", "randomk"):
            flags += ["--element-fraction", f"{self.fraction:g}"]
        if self.name == "blocktopk":
            if self.block_fraction is not None:
                flags += ["--block-fraction", f"{self.block_fraction:g}"]
            elif self.blocks_per_layer is not None:
                flags += ["--blocks-per-layer", str(self.blocks_per_layer)]
            if self.selection != "local":
                flags += ["--block-selection", self.selection]
            if self.block_size != DEFAULT_BLOCK_SIZE and self.block_size is not None:
                flags += ["--block-size", str(self.block_size)]
            if self.dense_below != DEFAULT_DENSE_BELOW:
                flags += ["--dense-below", str(self.dense_below)]
        if self.name == "powersgd":
            flags += ["--powersgd-rank", str(self.rank)]
        return flags


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
