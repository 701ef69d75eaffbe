"""Gradient blocks of contiguous memory: cutting, scoring and choosing them.

A flat layer gradient is the concatenation of its parameters' gradients. With a
block size ``N`` each parameter is cut into blocks of ``N`` elements (exactly:
of the largest divisor of its size that is at most ``N``, which for the usual
shapes is ``N`` itself), so a small and a large layer are cut alike and a
fraction of blocks is about the same fraction of elements. Without one (the
seed's cut, ``block_size=None``) each parameter is cut along its first dimension:

* a conv weight ``(F, C, kh, kw)``: ``F`` blocks, one filter (``C*kh*kw`` values) each;
* a linear weight ``(out, in)``: ``out`` blocks, one output neuron's row each;
* a bias, or any 1-D or 0-D parameter: one block per element;
* any other weight of two or more dimensions: ``shape[0]`` blocks of ``prod(shape[1:])``.

Every block is a contiguous slice of the flat gradient, so a chosen block is a
base offset and a length: no per-element index crosses the network.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from convoy.compress.base import Support

METRICS = ("l1", "l2")


@dataclass(frozen=True)
class Segment:
    """One parameter's place in the flat gradient and how it is cut.

    Attributes:
        shape: the parameter's shape.
        offset: index of its first element in the flat gradient.
        blocks: how many blocks it is cut into.
        block_size: elements per block.
    """

    shape: tuple[int, ...]
    offset: int
    blocks: int
    block_size: int

    @property
    def numel(self) -> int:
        return self.blocks * self.block_size

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The ``(blocks, block_size)`` view of this parameter inside ``flat``."""
        return flat[self.offset:self.offset + self.numel].view(self.blocks, self.block_size)


def cut(shape: Sequence[int], block_size: int | None = None) -> tuple[int, int]:
    """``(blocks, block_size)`` of a parameter of ``shape``, by the rules of the module doc.

    Args:
        shape: the parameter's shape.
        block_size: elements per block (at most); ``None`` cuts along the first dimension.

    Example::

        >>> cut((64, 3, 3, 3)), cut((10, 84)), cut((10,)), cut(())
        ((64, 27), (10, 84), (10, 1), (1, 1))
        >>> cut((64, 3, 3, 3), 256), cut((10,), 256), cut((7, 11), 8)
        ((8, 216), (1, 10), (11, 7))
    """
    numel = math.prod(shape)
    if numel == 0:
        return 0, 1
    if block_size is not None:
        size = largest_divisor(numel, block_size)
        return numel // size, size
    if len(shape) < 2:
        return numel, 1
    return shape[0], numel // shape[0]


def largest_divisor(numel: int, at_most: int) -> int:
    """The largest divisor of ``numel`` that is at most ``at_most`` (blocks then tile it exactly).

    Example::

        >>> largest_divisor(1728, 256), largest_divisor(10, 256), largest_divisor(13, 4)
        (216, 10, 1)
    """
    if at_most < 1:
        raise ValueError(f"block size must be >= 1, got {at_most}")
    if numel <= at_most:
        return numel
    small = next(d for d in range(math.ceil(numel / at_most), numel + 1) if numel % d == 0)
    return numel // small


# Elements per abs() pass in row_l1: small enough to stay in cache.
_L1_CHUNK = 1 << 17


def row_l1(rows: torch.Tensor) -> torch.Tensor:
    """The L1 norm of each row of a 2-D tensor, at about twice the cost of one read pass.

    On CPU, ``vector_norm(ord=1)`` takes a slow path (3-10x a read pass) and
    ``abs().sum(1)`` writes a temporary as large as the gradient; instead take
    ``abs()`` of a few rows at a time into a small reused buffer and sum those.
    """
    count, size = rows.shape
    if rows.device.type != "cpu" or count * size <= _L1_CHUNK:
        return rows.abs().sum(1)
    step = max(1, _L1_CHUNK // size)
    out = rows.new_empty(count)
    buffer = rows.new_empty(min(step, count), size)
    for start in range(0, count, step):
        part = rows[start:start + step]
        scratch = buffer[:part.shape[0]]
        torch.abs(part, out=scratch)
        torch.sum(scratch, 1, out=out[start:start + part.shape[0]])
    return out


def row_l2(rows: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row of a 2-D tensor (one read pass)."""
    return torch.linalg.vector_norm(rows, ord=2, dim=1)


class BlockLayout:
    """The blocks of a flat gradient made of parameters of ``shapes``.

    Args:
        shapes: the parameters' shapes, in the order they are concatenated.
        block_size: elements per block (see :func:`cut`); ``None``: rows.
        dense_below: a parameter of fewer elements keeps all its blocks, whatever
            the count or fraction asked (0: none does).

    Example::

        >>> layout = BlockLayout([(6, 1, 5, 5), (6,)])
        >>> layout.total_blocks, layout.numel
        (12, 156)
        >>> BlockLayout([(6, 1, 5, 5), (6,)], block_size=64).total_blocks
        4
    """

    def __init__(self, shapes: Sequence[Sequence[int]], block_size: int | None = None, dense_below: int = 0):
        if dense_below < 0:
            raise ValueError(f"dense_below must be >= 0, got {dense_below}")
        self.block_size, self.dense_below = block_size, dense_below
        segments, offset = [], 0
        for shape in shapes:
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in shape {shape}")
            blocks, size = cut(shape, block_size)
            segments.append(Segment(shape, offset, blocks, size))
            offset += blocks * size
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.numel = offset
        self.total_blocks = sum(s.blocks for s in self.segments)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.shape for s in self.segments)

    def scores(self, flat: torch.Tensor, metric: str = "l1") -> torch.Tensor:
        """The norm of every block, segment after segment (``total_blocks`` values).

        One read pass over the gradient: a vector norm per row of each
        segment's ``(blocks, block_size)`` view; no sort over elements.
        """
        if metric not in METRICS:
            raise ValueError(f"unknown block metric {metric!r}; choose one of: {', '.join(METRICS)}")
        if flat.numel() != self.numel:
            raise ValueError(f"gradient has {flat.numel()} values, the layout {self.numel}")
        norm = row_l1 if metric == "l1" else row_l2
        parts = [norm(s.view(flat)) for s in self.segments]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    def select(self, scores: torch.Tensor, count: int | None = None,
               fraction: float | None = None, density: float | None = None) -> list[torch.Tensor]:
        """The highest-scoring blocks of each segment, as sorted block indices.

        Args:
            scores: from :meth:`scores` (possibly summed over ranks).
            count: blocks kept per segment (capped at the segment's blocks).
            fraction: or this fraction of each segment's blocks, rounded, at least one.
            density: keep at least this fraction of each segment's blocks (a warm-up's ramp).
        """
        kept, start = [], 0
        for s, k in zip(self.segments, self.kept_counts(count, fraction, density)):
            mine = scores[start:start + s.blocks]
            start += s.blocks
            if k >= s.blocks:
                kept.append(torch.arange(s.blocks, device=scores.device))
            else:
                kept.append(torch.topk(mine, k, sorted=False).indices.sort().values)
        return kept

    def kept_counts(self, count: int | None = None, fraction: float | None = None,
                    density: float | None = None) -> list[int]:
        """Blocks :meth:`select` keeps of each segment for ``count`` or ``fraction`` (and ``density``);
        all of a segment of fewer than ``dense_below`` elements."""
        if (count is None) == (fraction is None):
            raise ValueError("give count or fraction, not both")
        floor = density or 0.0
        return [s.blocks if s.numel < self.dense_below else
                min(s.blocks, max(count if count is not None else max(1, round(fraction * s.blocks)),
                                  round(floor * s.blocks)))
                for s in self.segments]

    def gather(self, flat: torch.Tensor, kept: Sequence[torch.Tensor]) -> torch.Tensor:
        """The values of the kept blocks, segment after segment, as one flat tensor."""
        parts = [s.view(flat).index_select(0, idx).reshape(-1) for s, idx in zip(self.segments, kept)]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    def scatter(self, values: torch.Tensor, kept: Sequence[torch.Tensor]) -> torch.Tensor:
        """A dense flat tensor: ``values`` (from :meth:`gather`) at the kept blocks, zeros elsewhere."""
        return self._place(values, kept, values.new_zeros(self.numel), add=False)

    def scatter_add(self, values: torch.Tensor, kept: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Add ``values`` (from :meth:`gather`) to the kept blocks of the flat ``out``, in place."""
        if out.numel() != self.numel:
            raise ValueError(f"out holds {out.numel()} values, the layout {self.numel}")
        return self._place(values, kept, out, add=True)

    def support(self, *kept: Sequence[torch.Tensor]) -> "KeptBlocks":
        """Where a sum of payloads that kept these blocks (sorted indices per segment, one list
        per payload) may be non-zero.

        Example::

            >>> BlockLayout([(2, 3), (2,)]).support([torch.tensor([1]), torch.tensor([0, 1])]).ranges()[0].tolist()
            [3, 6, 7]
        """
        return KeptBlocks(self, kept)

    def _place(self, values: torch.Tensor, kept: Sequence[torch.Tensor], out: torch.Tensor,
               add: bool) -> torch.Tensor:
        start = 0
        for s, idx in zip(self.segments, kept):
            n = idx.numel() * s.block_size
            rows = values[start:start + n].view(-1, s.block_size)
            if add:
                s.view(out).index_add_(0, idx, rows)
            else:
                s.view(out).index_copy_(0, idx, rows)
            start += n
        if start != values.numel():
            raise ValueError(f"{values.numel()} values for {start} kept elements")
        return out


class KeptBlocks(Support):
    """The blocks of a :class:`BlockLayout` that one or more payloads carried, as a :class:`Support`."""

    def __init__(self, layout: BlockLayout, kept: Sequence[Sequence[torch.Tensor]]):
        self.layout, self.kept = layout, kept

    def ranges(self) -> tuple[np.ndarray, np.ndarray]:
        segments = self.layout.segments
        offsets = np.array([s.offset for s in segments], dtype=np.int64)
        sizes = np.array([s.block_size for s in segments], dtype=np.int64)
        starts, lengths = [], []
        for kept in self.kept:
            counts = [idx.numel() for idx in kept]
            blocks = torch.cat(list(kept)).cpu().numpy().astype(np.int64) if sum(counts) else np.zeros(0, np.int64)
            block_sizes = np.repeat(sizes, counts)
            starts.append(np.repeat(offsets, counts) + blocks * block_sizes)
            lengths.append(block_sizes)
        empty = np.zeros(0, dtype=np.int64)
        return (np.concatenate(starts) if starts else empty), (np.concatenate(lengths) if lengths else empty)
