"""Cutting a layer's flat vector into slices, and putting it back together.

A slice is the unit of transfer, of scheduling and of the server's update: a
contiguous range of one layer's flattened parameters (weight, then bias). Every
rank builds the same table, so a slice's id names it on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Slice:
    """Elements ``offset .. offset + numel - 1`` of layer ``layer``'s flat vector.

    ``id`` is unique over the model; ``part`` is the slice's position in its layer.
    """

    id: int
    layer: int
    part: int
    offset: int
    numel: int


def cut(numel: int, slice_numel: int | None) -> list[tuple[int, int]]:
    """(offset, length) of each slice of a vector of ``numel`` elements; ``None``: one slice.

    Example::

        >>> cut(10, 4)
        [(0, 4), (4, 4), (8, 2)]
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if slice_numel is not None and slice_numel < 1:
        raise ValueError(f"slice_numel must be >= 1, got {slice_numel}")
    if slice_numel is None or numel <= slice_numel:
        return [(0, numel)]
    return [(start, min(slice_numel, numel - start)) for start in range(0, numel, slice_numel)]


def slice_table(layer_numels: Sequence[int], slice_bytes: int | None, element_size: int = 4) -> list[list[Slice]]:
    """The slices of every layer, ids numbered in layer order."""
    slice_numel = None if slice_bytes is None else max(slice_bytes // element_size, 1)
    table, next_id = [], 0
    for layer, numel in enumerate(layer_numels):
        parts = []
        for part, (offset, length) in enumerate(cut(numel, slice_numel)):
            parts.append(Slice(next_id, layer, part, offset, length))
            next_id += 1
        table.append(parts)
    return table


def view(flat: torch.Tensor, piece: Slice) -> torch.Tensor:
    """The part of ``flat`` (a layer's flat vector) that ``piece`` covers, as a view."""
    return flat.narrow(0, piece.offset, piece.numel)


def split(flat: torch.Tensor, pieces: Sequence[Slice]) -> list[torch.Tensor]:
    """Views of ``flat`` for each slice."""
    return [view(flat, piece) for piece in pieces]


def join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat vector the slices came from."""
    return torch.cat([p.reshape(-1) for p in parts])
