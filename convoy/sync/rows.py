"""Fixed-width byte rows that carry a compressed payload between ranks.

A payload (a list of tensors of any dtypes and sizes) goes on the wire as one
uint8 row: the byte size of each tensor (int64), the tensors' bytes, zero
padding up to a width both ends agreed on. Rows of equal width can be
all-gathered or sent point to point, and decoded by any rank that knows the dtypes.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from convoy.compress.base import Compressor, Support


def row_extent(payload: list[torch.Tensor]) -> tuple[int, int]:
    """(header bytes, header + payload bytes) of ``payload``'s row before padding."""
    head = 8 * len(payload)
    return head, head + sum(t.numel() * t.element_size() for t in payload)


def pack_row(payload: list[torch.Tensor], width: int) -> torch.Tensor:
    """``payload`` as a uint8 row of ``width`` bytes (at least its ``row_extent``)."""
    # Rows are host memory whatever the payload's device: gloo carries them beside NCCL's gradients.
    parts = [t.contiguous().reshape(-1).cpu().view(torch.uint8) for t in payload]
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    used = row_extent(payload)[1]
    if used > width:
        raise ValueError(f"a payload of {used} bytes does not fit a row of {width}")
    row = torch.zeros(width, dtype=torch.uint8)
    torch.cat([sizes.view(torch.uint8), *parts], out=row[:used])
    return row


def unpack_row(row: torch.Tensor, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The payload tensors of ``row`` (flat), checked against the row's width."""
    head, width = 8 * len(dtypes), row.numel()
    sizes = row[:head].clone().view(torch.int64).tolist()
    if min(sizes, default=0) < 0 or head + sum(sizes) > width:
        raise RuntimeError(f"a peer's payload sizes {sizes} do not fit its row of {width} bytes")
    pieces = row[head:head + sum(sizes)].split(sizes)
    # clone: a slice at an odd byte offset cannot be viewed as wider values.
    return [piece.clone().view(dtype) for piece, dtype in zip(pieces, dtypes)]


def sum_rows(compressor: Compressor, rows: Sequence[torch.Tensor], dtypes: list[torch.dtype],
             ctx: Any, device: torch.device | None = None) -> tuple[torch.Tensor, Support | None]:
    """The sum of the dense tensors the ``rows`` carry, added in the order given, and where it
    may be non-zero (:meth:`Compressor.decompress_sum`); on ``device`` when given (the rows,
    and the sum of their host-coded payloads, are on the CPU).

    Every rank adds the same rows in the same order, so every rank gets the
    identical sum. One dense tensor is built; the other rows are added into it,
    which for sparse payloads touches only what they carry.
    """
    total, support = compressor.decompress_sum([unpack_row(row, dtypes) for row in rows], ctx)
    return (total if device is None else total.to(device)), support
