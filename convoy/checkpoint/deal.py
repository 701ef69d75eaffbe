"""The arithmetic of a resume on another world: re-deal per-rank state, combine clusters' state.

What is preserved. The next update is the *average* of what the workers send,
``(1/W) sum_i sent_i``; what error feedback still owes to it is
``(1/W) sum_i r_i``, and momentum correction's velocity enters it the same way
(with a dense compressor, ``(1/W) sum_i u_i`` *is* momentum SGD's buffer). So
additive state (``residual``, ``velocity``) is dealt so that its mean over the
workers is kept: ``sum_j r'_j / M == sum_i r_i / N``. Keeping the plain sum
instead would multiply what is owed by ``N / M`` (twice the momentum after
going from 4 workers to 2).

How it is exact (:func:`deal_mean`). Where ``M`` is a multiple of ``N`` each
old tensor is copied to ``M / N`` new ranks: exact. Otherwise, per element,
``T = (M / N) * sum_i r_i`` is formed in float64 and split into float32 parts
whose exact sum is ``T``: ``a = fl32(T / (M - 1))`` on each of the first
``M - 1`` ranks and the tail ``t = T - (M - 1) a`` on the last. ``(M - 1) a``
is exact in float64 (24 bits times a small integer); it is within a factor 2
of ``T``, so ``T - (M - 1) a`` is exact (Sterbenz), and ``t`` is about
``2^-24 T``: it fits a float32 whenever ``T`` has at most ~48 significant bits,
which is checked element by element (``T - (M - 1) a == t`` in float64, both
sides exact). An element where it does not fit gets the greedy float32
expansion of ``T`` over the ``M`` ranks (``fl32(T)``, then ``fl32`` of what is
left, ...), exact when ``T`` needs at most ``M`` float32 terms; the elements
where even that leaves something are counted (``Deal.inexact``) and reported.
``T`` itself is exact when ``N`` is a power of two and an element's values
span less than about ``2^26`` in magnitude (then the float64 sum of the N
float32 values and the scaling are exact); otherwise it is within one float64
rounding (``2^-53``) of the true value. The bulk sits evenly on ``M - 1`` ranks
and the last rank holds only rounding tails (with ``M = 2`` the first holds
it all): any split with the right sum owes the same update.

Other state: PowerSGD's warm start ``Q`` is the all-reduced sum every rank
keeps alike: rank 0's is copied to every new rank. The RNG of new rank ``j``
is old rank ``j mod N``'s; floating-point buffers (batch-norm statistics) are
their mean over the old ranks, others rank 0's; the fp16 loss scale is rank
0's. A key of any other kind is refused, never dropped.

Example::

    >>> new, inexact = deal_mean([r0, r1, r2, r3], 3)   # sum(new) / 3 == sum(old) / 4
"""
from __future__ import annotations

import torch

from convoy.errors import UsageError

ADDITIVE = ("residual", "velocity")   # sync state kinds whose mean over the workers enters the update
SHARED = ("powersgd_q",)              # sync state kinds every rank holds alike


def deal_mean(parts: list[torch.Tensor], world: int) -> tuple[list[torch.Tensor], int]:
    """``world`` float32 tensors whose mean equals the mean of ``parts`` (see the module's text).

    Returns the tensors and the number of elements where the mean could not be kept exactly.

    Example::

        >>> new, inexact = deal_mean([r0, r1, r2, r3], 3)   # sum(new) / 3 == sum(old) / 4
    """
    old = len(parts)
    if world % old == 0:
        return [parts[j % old].clone() for j in range(world)], 0
    # Element-wise throughout: a block of elements at a time, so that the float64 temporaries stay
    # in the cache (the same operations on each element: the same bits as on the whole tensor).
    flat = [part.reshape(-1) for part in parts]
    out = [torch.empty(flat[0].numel(), dtype=torch.float32) for _ in range(world)]
    inexact = 0
    for start in range(0, flat[0].numel(), _BLOCK):
        end = min(start + _BLOCK, flat[0].numel())
        inexact += _deal_block([part[start:end] for part in flat], [o[start:end] for o in out])
    return [o.view(parts[0].shape) for o in out], inexact


_BLOCK = 1 << 15   # elements dealt at a time


def _deal_block(parts: list[torch.Tensor], out: list[torch.Tensor]) -> int:
    """:func:`deal_mean` of flat ``parts`` into ``out`` (one float32 tensor per new rank); returns
    the number of elements whose mean could not be kept exactly."""
    old, world = len(parts), len(out)
    total, rounded = _exact_scaled_sum(parts, world)
    target = total / old   # exact when ``old`` is a power of two; else one float64 rounding (not counted)
    if world == 1:
        out[0].copy_(target)
        return int(((out[0].double() != target) | rounded).sum())
    bulk = (target / (world - 1)).float()
    bulk_sum = bulk.double() * (world - 1)
    tail = (target - bulk_sum).float()
    fits = (target - bulk_sum) == tail.double()
    for j in range(world - 1):
        out[j].copy_(bulk)
    out[-1].copy_(tail)
    inexact = 0
    if not bool(fits.all()):
        # The greedy float32 expansion of the target over every rank, where the tail did not fit.
        left = target.clone()
        for j in range(world):
            term = left.float()
            left = left - term.double()
            out[j].copy_(torch.where(fits, out[j], term))
        inexact = int(((left != 0) & ~fits).sum())
    return inexact + int((rounded & fits).sum())


def _exact_scaled_sum(parts: list[torch.Tensor], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``world * sum(parts)`` in float64, and where that is not exact: each addition's error is
    found by TwoSum (Knuth), the product's by splitting the sum in halves of 26 and 27 bits
    (Veltkamp), each of which times a small integer is exact."""
    total = torch.zeros(parts[0].shape, dtype=torch.float64)
    rounded = torch.zeros(parts[0].shape, dtype=torch.bool)
    for part in parts:
        value = part.double()
        new = total + value
        back = new - total
        rounded |= ((total - (new - back)) + (value - back)) != 0
        total = new
    product = total * world
    split = total * 134217729.0   # 2^27 + 1
    high = split - (split - total)
    low = total - high
    rounded |= ((high * world - product) + low * world) != 0
    return product, rounded


def deal_states(states: list[dict[str, torch.Tensor]], world: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Rank states (rank file tensors by key) of ``len(states)`` workers, dealt to ``world``.

    Raises:
        UsageError: the old ranks hold different keys or shapes, or a key of a kind
            that cannot be re-dealt (it is never dropped silently).
    """
    keys = list(states[0])
    for rank, state in enumerate(states[1:], 1):
        if list(state) != keys or any(state[k].shape != states[0][k].shape for k in keys):
            raise UsageError(f"rank files 0 and {rank} hold different state; they are not of one job")
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    inexact = 0
    for key in keys:
        column = [state[key] for state in states]
        kind = key.split(".", 1)[0]
        sub = key.split(".", 2)[1] if kind == "sync" and key.count(".") >= 2 else ""
        if kind == "sync" and sub in ADDITIVE and column[0].is_floating_point():
            dealt, missed = deal_mean(column, world)
            inexact += missed
        elif (kind == "sync" and sub in SHARED) or kind == "scaler":
            dealt = [column[0].clone() for _ in range(world)]
        elif kind == "rng":
            dealt = [column[j % len(column)].clone() for j in range(world)]
        elif kind == "buffer":
            if column[0].is_floating_point():
                mean = (sum(t.double() for t in column) / len(column)).to(column[0].dtype)
                dealt = [mean.clone() for _ in range(world)]
            else:
                dealt = [column[0].clone() for _ in range(world)]
        else:
            raise UsageError(f"the rank files hold {key!r}, per-rank state convoy cannot re-deal to {world} "
                             "workers; resume on the checkpoint's own number of workers")
        for j in range(world):
            out[j][key] = dealt[j].contiguous()
    return out, inexact


def combine_clusters(columns: list[list[torch.Tensor]], weights: list[float]) -> torch.Tensor:
    """``sum_k w_k mean(columns[k])``: each cluster's mean over its members (what the cluster's
    update owes to it, or its one model's value), then the clusters' weighted sum, as the next
    inter-cluster exchange forms it; in float64, rounded once to the values' dtype. A value every
    member of every cluster holds alike comes back as it was: the weights sum to 1 within a few
    float64 roundings, far below float32's.

    Example::

        >>> combine_clusters([[r0, r1], [r2, r3]], [0.4, 0.6])   # 0.4 (r0 + r1) / 2 + 0.6 (r2 + r3) / 2
    """
    total = torch.zeros(columns[0][0].shape, dtype=torch.float64)
    for weight, column in zip(weights, columns):
        total += weight * (sum(t.double() for t in column) / len(column))
    return total.to(columns[0][0].dtype)
