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
# the bytes; layers under this fraction of a piece stay whole.
PIECES_PER_SHARE = 4


def split_layers(layer_numels: Sequence[int], layer_rows: Sequence[int | None],
                 servers: int) -> list[tuple[int, int | None, int | None]]:
    """Cut the large layers into units of whole rows (dim 0 of every parameter of the layer).

    Colocated servers each hold 1/N of the model. A layer larger than a
    sixteenth of that share is cut into a multiple of N row ranges, each at
    most about a quarter of the share (a layer whose parameters do not share
    dim 0 stays whole), and :func:`place_units` gives every server an equal
    share of it: the next forward needs a layer whole, so its bytes should
    come from every server's link at once, not from one (vgg_fc at 4 ranks:
    the FC layers and the two last convolutions are cut, the rest, 2% of the
    bytes, stays whole). No server's link then carries much more than its share.

    Returns:
        ``(layer, first row, end row)`` per unit, in layer order; rows ``None``: the whole layer.

    Example::

        >>> split_layers([40, 8, 1], [4, 2, None], servers=2)   # units of at most 49 / 2 / 4 = 6 elements
        [(0, 0, 1), (0, 1, 2), (0, 2, 3), (0, 3, 4), (1, 0, 1), (1, 1, 2), (2, None, None)]
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    largest = sum(layer_numels) / servers / PIECES_PER_SHARE
    units: list[tuple[int, int | None, int | None]] = []
    for layer, (numel, rows) in enumerate(zip(layer_numels, layer_rows)):
        parts = min(rows or 1, servers * math.ceil(numel / largest / servers)) if largest > 0 else 1
        if numel <= largest / PIECES_PER_SHARE or parts <= 1:
            units.append((layer, None, None))
            continue
        bounds = [rows * k // parts for k in range(parts + 1)]
        units += [(layer, start, end) for start, end in zip(bounds, bounds[1:])]
    return units


def place_units(units: Sequence[tuple[int, int | None, int | None]], unit_bytes: Sequence[int],
                servers: int, weights: Sequence[float] = ()) -> list[int]:
    """The server (0..servers-1) of each unit of :func:`split_layers`: a cut layer's units dealt round the
    servers, then the whole layers largest first on the least-loaded server.

    Without ``weights`` a cut layer's k-th unit goes to server (layer + k) mod
    ``servers``, so each server holds an equal share of it (its units are equal
    to within a row); the whole layers then even out the totals as
    :func:`shard_layers` does. ``weights`` (one > 0 per server) asks for shares
    in proportion: a cut layer's units are dealt by smooth weighted round-robin
    (equal weights deal them exactly as without), and "least loaded" is the
    load over the weight. A rank on a link four times slower than the others'
    does best with a small share: its link carries its pushes of the others'
    units and its replies to every other rank.

    Example::

        >>> place_units([(0, 0, 1), (0, 1, 2), (1, None, None), (2, None, None)], [8, 8, 6, 2], servers=2)
        [0, 1, 0, 1]
        >>> place_units([(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, None, None)], [8, 8, 8, 6], 2, weights=[2, 1])
        [0, 1, 0, 0]
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    weights = list(weights) or [1.0] * servers
    if len(weights) != servers or not min(weights) > 0:
        raise ValueError(f"weights needs one value > 0 per server ({servers}), got {weights}")
    weights = [w / max(weights) for w in weights]   # equal weights become exactly 1: ties stay ties
    owner = [0] * len(units)
    load = [0.0] * servers
    cut: dict[int, list[int]] = {}
    for unit, (layer, start, _) in enumerate(units):
        if start is not None:
            cut.setdefault(layer, []).append(unit)
    for layer, members in cut.items():
        for unit, server in zip(members, _deal(len(members), weights, first=layer % servers)):
            owner[unit] = server
            load[server] += unit_bytes[unit]
    whole = [u for u, (_, start, _) in enumerate(units) if start is None]
    for unit in sorted(whole, key=lambda u: (-unit_bytes[u], u)):
        owner[unit] = min(range(servers), key=lambda s: (load[s] / weights[s], s))
        load[owner[unit]] += unit_bytes[unit]
    return owner


def _deal(count: int, weights: Sequence[float], first: int) -> list[int]:
    """``count`` turns of smooth weighted round-robin over the servers, ties to ``first`` and those after it."""
    n, total = len(weights), sum(weights)
    credit = [0.0] * n
    turns = []
    for _ in range(count):
        for s in range(n):
            credit[s] += weights[s]
        server = max(range(n), key=lambda s: (credit[s], -((s - first) % n)))
        credit[server] -= total
        turns.append(server)
    return turns


def link_shares(rates: Sequence[float], least: float = 0.01) -> list[float]:
    """Shares of the parameters for colocated servers on links of ``rates`` that make the slowest link's
    step shortest (for ``place_units``'s ``weights``, or ``--shard-weights``).

    A rank owning a share f of the model sends its gradient of the others'
    units, (1 - f) of the model, and its units to the N - 1 other ranks,
    (N - 1) f: (1 + (N - 2) f) of the model each way. Equal shares give every
    link 2 (N - 1) / N, as a ring does; a rank on a slow link does best with
    nothing to serve, the fast ones sharing its part. Shares that would be
    zero are ``least`` (every rank keeps a server).

    Example::

        >>> [round(s, 3) for s in link_shares([100e6, 100e6, 100e6, 25e6])]
        [0.33, 0.33, 0.33, 0.01]
        >>> link_shares([1e9] * 4)
        [0.25, 0.25, 0.25, 0.25]
    """
    n = len(rates)
    if n < 1 or not min(rates) > 0:
        raise ValueError(f"rates needs one link rate > 0 per rank, got {list(rates)}")
    if n <= 2 or len(set(rates)) == 1:   # with two ranks every split moves the same bytes
        return [1 / n] * n
    serving = list(range(n))
    while True:   # the busiest link's time T, with (1 + (N - 2) f_i) / r_i = T for every rank that serves
        period = (n - 2 + len(serving)) / sum(rates[i] for i in serving)
        keep = [i for i in serving if period * rates[i] >= 1]
        if keep == serving:
            break
        serving = keep
    shares = [max((period * rates[i] - 1) / (n - 2), 0.0) if i in serving else 0.0 for i in range(n)]
    shares = [max(s, least) for s in shares]
    return [s / sum(shares) for s in shares]
