"""Block-sparse top-k: keep each parameter's highest-norm blocks of contiguous memory."""
from __future__ import annotations

from typing import Any

import torch

from convoy.compress import rle
from convoy.compress.base import Compressor, LayerInfo, Memory, Payload, ResidualMemory, Support
from convoy.compress.blocks import METRICS, BlockLayout
from convoy.compress.registry import CompressorSpec, register

SELECTIONS = ("local", "global")
# The defaults convoy train and the DDP hooks use (chosen by measurement on vgg_fc, docs/compression.md):
# L2 scores ended nearer dense than L1; 16-element blocks cut small and large layers alike; parameters
# under 16384 elements (biases, small layers, a classifier head) go whole every step.
DEFAULT_METRIC = "l2"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DENSE_BELOW = 16384
# Each rank picks its own blocks (global scoring costs an all-reduce of the scores first), and keeps
# one block per parameter unless told a share.
DEFAULT_SELECTION = "local"
DEFAULT_BLOCKS_PER_LAYER = 1


class BlockTopKCompressor(Compressor):
    """Keep the k blocks of largest L1 (or L2) norm of every parameter, zero the rest.

    Blocks are runs of ``block_size`` contiguous elements of a parameter, or,
    without a block size, its filters, rows and bias elements
    (:mod:`convoy.compress.blocks`).
    With ``selection="local"`` (the seed) each rank picks its own blocks and
    sends them run-length coded (:mod:`convoy.compress.rle`); payloads differ
    between ranks, so they are gathered, not summed. With ``"global"`` the
    ranks first sum their block scores, pick the same blocks, and send only
    those blocks' raw values, which all-reduce (traffic does not grow with
    the number of workers). Pair it with :class:`ResidualMemory` for error
    feedback.

    Args:
        blocks_per_layer: blocks kept per parameter (default 1).
        fraction: instead, this fraction of each parameter's blocks, rounded,
            at least one; exclusive with ``blocks_per_layer``.
        metric: ``"l1"`` or ``"l2"``, the norm that scores a block.
        selection: ``"local"`` or ``"global"``.
        block_size: elements per block; ``None`` cuts parameters along their
            first dimension (a block is a row or a filter).
        dense_below: parameters of fewer elements are sent whole every step
            (small layers cost few bytes, and a classifier head sent at 1%
            delays the whole network's start); 0: every parameter is cut.

    Example::

        >>> c = BlockTopKCompressor(blocks_per_layer=1)
        >>> payload, ctx = c.compress(grad, "3", LayerInfo(shapes=(w.shape, b.shape)))
        >>> sparse = c.decompress(payload, ctx)
    """

    def __init__(self, blocks_per_layer: int | None = None, fraction: float | None = None,
                 metric: str = DEFAULT_METRIC, selection: str = DEFAULT_SELECTION, block_size: int | None = None,
                 dense_below: int = 0):
        if blocks_per_layer is not None and fraction is not None:
            raise ValueError("give blocks_per_layer or fraction, not both")
        if blocks_per_layer is None and fraction is None:
            blocks_per_layer = DEFAULT_BLOCKS_PER_LAYER
        if blocks_per_layer is not None and blocks_per_layer < 1:
            raise ValueError(f"blocks_per_layer must be >= 1, got {blocks_per_layer}")
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if metric not in METRICS:
            raise ValueError(f"unknown block metric {metric!r}; choose one of: {', '.join(METRICS)}")
        if selection not in SELECTIONS:
            raise ValueError(f"unknown block selection {selection!r}; choose one of: {', '.join(SELECTIONS)}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if dense_below < 0:
            raise ValueError(f"dense_below must be >= 0, got {dense_below}")
        self.blocks_per_layer, self.fraction, self.block_size = blocks_per_layer, fraction, block_size
        self.dense_below = dense_below
        self.density = fraction
        self.metric, self.selection = metric, selection
        # Globally chosen blocks are the same on every rank: their values add up.
        self.summable = selection == "global"
        self.local = selection == "local"   # global selection agrees on block scores
        self._layouts: dict[tuple, BlockLayout] = {}

    def layout(self, tensor: torch.Tensor, info: LayerInfo | None) -> BlockLayout:
        """The block layout of ``tensor``: its parameters' shapes, or one 1-D parameter."""
        shapes = tuple(tuple(s) for s in info.shapes) if info and info.shapes else ((tensor.numel(),),)
        layout = self._layouts.get(shapes)
        if layout is None:
            layout = self._layouts[shapes] = BlockLayout(shapes, self.block_size, self.dense_below)
        if layout.numel != tensor.numel():
            raise ValueError(f"shapes {shapes} hold {layout.numel} values, the gradient {tensor.numel()}")
        return layout

    def compress(self, tensor: torch.Tensor, name: str,
                 info: LayerInfo | None = None) -> tuple[Payload, Any]:
        layout = self.layout(tensor, info)
        scores = layout.scores(tensor, self.metric)
        if self.selection == "global":
            scores = (info or LayerInfo()).agree(scores)
        density = info.density if info else None
        kept = layout.select(scores, self.blocks_per_layer, self.fraction, density)
        if self.selection == "global":
            return [layout.gather(tensor, kept)], (layout, kept)
        return [rle.encode(tensor, layout, kept)], (layout, tensor.dtype, density)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        if self.selection == "global":
            layout, kept = ctx
            return layout.scatter(payload[0], kept)
        return rle.decode(payload[0], ctx[0].shapes, self.block_size)

    def decompress_add(self, payload: Payload, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        if self.selection == "global":
            layout, kept = ctx
            return layout.scatter_add(payload[0], kept, out)
        return rle.decode_add(payload[0], out, ctx[0].shapes, self.block_size)

    def decompress_sum(self, payloads: list[Payload], ctx: Any) -> tuple[torch.Tensor, Support | None]:
        if self.selection == "global":
            total, _ = super().decompress_sum(payloads, ctx)
            layout, kept = ctx
            return total, layout.support(kept)
        return rle.decode_sum([payload[0] for payload in payloads], ctx[0].shapes, self.block_size)

    def max_payload_bytes(self, ctx: Any) -> int | None:
        if self.selection == "global":
            return None
        layout, dtype, density = ctx
        return rle.max_encoded_bytes(layout, layout.kept_counts(self.blocks_per_layer, self.fraction, density), dtype)


def _build(blocks_per_layer: int | None = None, block_fraction: float | None = None,
           block_metric: str = DEFAULT_METRIC, block_selection: str = DEFAULT_SELECTION,
           block_size: int | None = DEFAULT_BLOCK_SIZE, dense_below: int = DEFAULT_DENSE_BELOW,
           ) -> tuple[Compressor, Memory]:
    return (BlockTopKCompressor(blocks_per_layer, block_fraction, block_metric, block_selection, block_size,
                                dense_below), ResidualMemory())


register(CompressorSpec(
    "blocktopk", _build,
    options=("blocks_per_layer", "block_fraction", "block_metric", "block_selection", "block_size", "dense_below"),
    sparse=True, momentum_corrected=True,
    hook_options={o: o for o in ("block_fraction", "blocks_per_layer", "block_metric", "block_selection")}))
