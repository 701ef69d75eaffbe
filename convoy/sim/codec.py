"""What a compressor puts on the wire for one layer.

Sizes come from the compressors' own arithmetic (``kept_count``,
``BlockLayout``, ``rle.max_encoded_bytes``), so they match what
``convoy.sync.AllReduce`` sends byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass

from convoy.compress.blocks import BlockLayout
from convoy.compress.topk import kept_count
from convoy.errors import UsageError

COMPRESSORS = ("none", "fp16", "randomk", "topk", "blocktopk")

# AllReduce's all-gather row starts with one int64 size per payload tensor.
_SIZE_HEADER = 8


@dataclass(frozen=True)
class Compression:
    """A compressor and its knobs, as ``convoy train`` takes them.

    Args:
        name: one of ``COMPRESSORS``.
        fraction: topk/randomk's ``--element-fraction``.
        blocks_per_layer, block_fraction: blocktopk's two ways of choosing how many blocks.
        selection: blocktopk's ``local`` (all-gathered) or ``global`` (all-reduced).

    Example::

        >>> Compression("topk", fraction=0.01).payload(((1000, 100),))
        ('allgather', 8016)
    """

    name: str = "none"
    fraction: float = 0.01
    blocks_per_layer: int | None = None
    block_fraction: float | None = None
    selection: str = "local"

    def __post_init__(self) -> None:
        if self.name not in COMPRESSORS:
            raise UsageError(f"unknown compressor {self.name!r}; choose one of: {', '.join(COMPRESSORS)}")
        if not 0 < self.fraction <= 1 or (self.block_fraction is not None and not 0 < self.block_fraction <= 1):
            raise UsageError("compression fractions must be in (0, 1]")

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
        layout = BlockLayout(shapes)
        # blocktopk's own default: one block per parameter.
        counts = layout.kept_counts(None if self.block_fraction is not None else (self.blocks_per_layer or 1),
                                    self.block_fraction)
        if self.selection == "global":
            return "allreduce", 4 * sum(k * s.block_size for k, s in zip(counts, layout.segments))
        from convoy.compress import rle
        import torch

        return "allgather", _SIZE_HEADER + rle.max_encoded_bytes(layout, counts, torch.float32)

    def agreement(self, shapes: tuple[tuple[int, ...], ...]) -> int:
        """Bytes of the all-reduce that must end before a layer's payload can be built:
        global blocktopk's block scores (the auxiliary thread waits for it); else 0."""
        if self.name != "blocktopk" or self.selection != "global":
            return 0
        return 4 * BlockLayout(shapes).total_blocks

    def label(self) -> str:
        if self.name in ("topk", "randomk"):
            return f"{self.name} {self.fraction:g}"
        if self.name == "blocktopk":
            kept = f"{self.block_fraction:g}" if self.block_fraction is not None else f"k={self.blocks_per_layer or 1}"
            return f"blocktopk {kept}" + (" global" if self.selection == "global" else "")
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
        return flags


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
