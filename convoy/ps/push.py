"""What a push carries: a layer's compressed gradient as one byte row, cut into slices.

A worker compresses each layer's gradient with the same compressor and
error-feedback memory an all-reduce would use (:mod:`convoy.compress`) and
puts the payload on the wire as a row (:mod:`convoy.sync.rows`). The row's
width at a step is what both ends can compute alone: the compressor's bound
on the payload, or, for a compressor without one, the payload's fixed size.
The server learns a step's widths and decoding context by compressing a zero
gradient of the layer's shapes at that step, asking for a remote payload
(``LayerInfo.remote``: the context then depends on shapes, step and density,
not on values; a compressor with rounds, PowerSGD, puts what its workers
agreed on in the payload), so it posts each receive at its exact size ahead
of the push and decodes the rows of every worker in worker order.

Push slices are cut from a row of the layer's capacity (the larger of the
dense row and the first step's compressed row), so slice ids, tags and
channels stay fixed from step to step; a step sends the slices that cover its
width, the last one cut short.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from convoy.compress import Compressor, LayerInfo
from convoy.sync.pipeline import CompressionPipeline
from convoy.sync.rows import row_extent
from convoy.ps.slicing import Slice


def wire_width(compressor: Compressor, payload: list[torch.Tensor], ctx: Any) -> int:
    """Bytes of the row that carries ``payload``: header plus the compressor's bound, else the payload."""
    head, used = row_extent(payload)
    bound = compressor.max_payload_bytes(ctx)
    return head + bound if bound is not None else used


def pieces_within(pieces: Sequence[Slice], width: int) -> list[tuple[Slice, int]]:
    """The slices of a row that cover its first ``width`` bytes, each with the bytes it carries."""
    return [(piece, min(piece.numel, width - piece.offset)) for piece in pieces if piece.offset < width]


class RowCodec:
    """The server's knowledge of every push row: width, dtypes and decoding context per layer and step.

    Args:
        pipeline: the workers' compression (compressor, warm-up), for the
            compressor and density each step uses (the same as all-reduce's).

    Example::

        >>> codec = RowCodec(CompressionPipeline(BlockTopKCompressor(fraction=0.1)))
        >>> width, dtypes, ctx, compressor = codec.row(3, numel=150, shapes=(w.shape, b.shape), step=0)
    """

    def __init__(self, pipeline: CompressionPipeline):
        self.pipeline = pipeline
        self._lock = threading.Lock()
        self._rows: dict[tuple[int, int], tuple[int, list[torch.dtype], Any, Compressor]] = {}

    def compressor_at(self, step: int) -> tuple[Compressor, float | None]:
        """The compressor and warm-up density of ``step`` (dense while a density-less compressor warms up)."""
        compressor = self.pipeline.compressor_at(step)
        return compressor, (self.pipeline.warmup_density(step) if compressor is self.pipeline.compressor else None)

    def row(self, layer: int, numel: int, shapes: tuple[torch.Size, ...],
            step: int) -> tuple[int, list[torch.dtype], Any, Compressor]:
        """(width, payload dtypes, decoding context, compressor) of ``layer``'s row at ``step`` (cached)."""
        key = (layer, step)
        with self._lock:
            if key not in self._rows:
                compressor, density = self.compressor_at(step)
                info = LayerInfo(shapes=shapes, agree=no_agreement, step=step, density=density, remote=True)
                payload, ctx = compressor.compress(torch.zeros(numel), str(layer), info)
                while compressor.more_rounds(ctx):   # a remote payload's context holds no round's values
                    payload, ctx = compressor.next_round(payload, ctx)
                self._rows[key] = (wire_width(compressor, payload, ctx), [t.dtype for t in payload], ctx, compressor)
            return self._rows[key]

    def forget(self, layer: int, step: int) -> None:
        with self._lock:
            self._rows.pop((layer, step), None)

    def capacity(self, layer: int, numel: int, shapes: tuple[torch.Size, ...], first_step: int) -> int:
        """Bytes of the largest row ``layer`` sends: the dense row or the first step's (the densest)."""
        dense = row_extent([torch.empty(numel)])[1]
        width = self.row(layer, numel, shapes, first_step)[0]
        self.forget(layer, first_step)
        return max(dense, width)


def no_agreement(tensor: torch.Tensor) -> torch.Tensor:
    """A ``LayerInfo.agree`` for pushes without a group of workers to agree over: refuses."""
    raise ValueError("this compressor makes the ranks agree on a selection (a collective over the workers); "
                     "a parameter server cannot decode such payloads: choose one that needs no agreement")
