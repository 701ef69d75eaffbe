"""Which server owns which layer: whole layers, balanced by bytes."""
from __future__ import annotations

import math
from typing import Sequence


def shard_layers(layer_bytes: Sequence[int], servers: int) -> list[int]:
    """The server (0..servers-1) of each layer, balancing the bytes each server holds.

    Largest layers first, each to the least-loaded server (ties: lower server,
    then lower layer index), so every rank computes the same map.

    Example::

        >>> shard_layers([100, 10, 60, 50], servers=2)
        [0, 0, 1, 1]
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    owner = [0] * len(layer_bytes)
    load = [0] * servers
    for layer in sorted(range(len(layer_bytes)), key=lambda i: (-layer_bytes[i], i)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[layer] = server
        load[server] += layer_bytes[layer]
    return owner


# A colocated shard's pieces: at most this fraction of one server's even share of
# the bytes, so the greedy placement above can balance the servers to within it.
PIECES_PER_SHARE = 4


def split_layers(layer_numels: Sequence[int], layer_rows: Sequence[int | None],
                 servers: int) -> list[tuple[int, int | None, int | None]]:
    """Cut the large layers into units of whole rows (dim 0 of every parameter of the layer).

    Colocated servers each hold 1/N of the model; a layer larger than a
    quarter of that share is cut into row ranges of about that size (a layer
    whose parameters do not share dim 0 stays whole), so that no server's link
    carries much more than its share.

    Returns:
        ``(layer, first row, end row)`` per unit, in layer order; rows ``None``: the whole layer.

    Example::

        >>> split_layers([40, 8], [4, None], servers=2)   # units of at most 48 / 2 / 4 = 6 elements
        [(0, 0, 1), (0, 1, 2), (0, 2, 3), (0, 3, 4), (1, None, None)]
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    largest = sum(layer_numels) / servers / PIECES_PER_SHARE
    units: list[tuple[int, int | None, int | None]] = []
    for layer, (numel, rows) in enumerate(zip(layer_numels, layer_rows)):
        parts = min(rows or 1, math.ceil(numel / largest)) if largest > 0 else 1
        if parts <= 1:
            units.append((layer, None, None))
            continue
        bounds = [rows * k // parts for k in range(parts + 1)]
        units += [(layer, start, end) for start, end in zip(bounds, bounds[1:])]
    return units
