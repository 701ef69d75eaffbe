"""Which server owns which layer: whole layers, balanced by bytes."""
from __future__ import annotations

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
