"""The run-length codec: round trips over random layouts, and corrupt payloads rejected."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.compress import BlockLayout
from convoy.compress.rle import CodecError, decode, decode_add, decode_sum, encode, max_encoded_bytes

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
shapes_st = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple), min_size=0, max_size=4)


@st.composite
def sparse_layers(draw):
    """A layout, a gradient, and kept blocks per segment at a drawn density (0, random, or 1)."""
    layout = BlockLayout(draw(shapes_st), draw(st.sampled_from([None, 1, 3, 16])))   # rows, or blocks of N
    dtype = draw(st.sampled_from(DTYPES))
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))).to(dtype)
    density = draw(st.sampled_from(["none", "random", "all", "one"]))
    kept = []
    for segment in layout.segments:
        if density == "none" or segment.blocks == 0:
            chosen = []
        elif density == "all":
            chosen = list(range(segment.blocks))
        elif density == "one":
            chosen = [draw(st.integers(0, segment.blocks - 1))]
        else:
            chosen = sorted(draw(st.sets(st.integers(0, segment.blocks - 1))))
        kept.append(torch.tensor(chosen, dtype=torch.int64))
    return layout, flat, kept


def _expected(layout, flat, kept):
    return layout.scatter(layout.gather(flat, kept), kept)


@settings(max_examples=200, deadline=None)
@given(sparse_layers())
def test_round_trip(case):
    layout, flat, kept = case
    payload = encode(flat, layout, kept)
    assert payload.numel() <= max_encoded_bytes(layout, [k.numel() for k in kept], flat.dtype)
    decoded = decode(payload, layout.shapes, layout.block_size)
    assert decoded.dtype == flat.dtype
    assert torch.equal(decoded, _expected(layout, flat, kept))


@settings(max_examples=100, deadline=None)
@given(sparse_layers())
def test_decode_add_equals_adding_the_decoded_tensor(case):
    layout, flat, kept = case
    payload = encode(flat, layout, kept)
    base = torch.randn(layout.numel).to(flat.dtype)
    assert torch.equal(decode_add(payload, base.clone(), layout.shapes, layout.block_size),
                       base + decode(payload, layout.shapes, layout.block_size))


@settings(max_examples=150, deadline=None)
@given(st.lists(sparse_layers(), min_size=1, max_size=3), st.data())
def test_decode_sum_adds_in_order_and_its_support_covers_every_non_zero(cases, data):
    """Several ranks' payloads of one layout: the sum is bit for bit decode then decode_add in
    order, and every element outside the support's ranges is +0.0 (its bits are zero)."""
    layout, flat, _ = cases[0]
    payloads = []
    for _, other, kept in cases:
        kept = [torch.tensor(sorted(data.draw(st.sets(st.integers(0, s.blocks - 1)))) if s.blocks else [],
                             dtype=torch.int64) for s in layout.segments]
        payloads.append(encode(torch.randn(layout.numel).to(flat.dtype), layout, kept))
    total, support = decode_sum(payloads, layout.shapes, layout.block_size)
    expected = decode(payloads[0], layout.shapes, layout.block_size)
    for payload in payloads[1:]:
        decode_add(payload, expected, layout.shapes, layout.block_size)
    assert torch.equal(total, expected)
    starts, lengths = support.ranges()
    assert (lengths >= 1).all() and (starts + lengths <= layout.numel).all()
    outside = torch.ones(layout.numel, dtype=torch.bool)
    for start, length in zip(starts.tolist(), lengths.tolist()):
        outside[start:start + length] = False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[total.element_size()]
    assert not total.view(bits)[outside].any()


def test_named_cases_empty_all_zero_all_kept_one_block():
    empty = BlockLayout([])
    assert decode(encode(torch.zeros(0), empty, []), ()).numel() == 0
    layout = BlockLayout([(4, 3), (4,)])
    flat = torch.arange(1.0, 17.0)
    none = [torch.zeros(0, dtype=torch.int64)] * 2
    assert torch.equal(decode(encode(flat, layout, none)), torch.zeros(16))
    every = [torch.arange(4), torch.arange(4)]
    assert torch.equal(decode(encode(flat, layout, every)), flat)
    one = decode(encode(flat, layout, [torch.tensor([2]), torch.tensor([0])]))
    assert torch.nonzero(one).flatten().tolist() == [6, 7, 8, 12]
    # Kept blocks cost their values plus 8 bytes per run: runs, not indices, are coded.
    assert encode(flat, layout, every).numel() == encode(flat, layout, none).numel() + 16 * 4 + 2 * 8


@settings(max_examples=100, deadline=None)
@given(sparse_layers(), st.data())
def test_truncated_and_bit_flipped_payloads_are_rejected(case, data):
    layout, flat, kept = case
    payload = encode(flat, layout, kept)
    cut = data.draw(st.integers(0, payload.numel() - 1))
    with pytest.raises(CodecError):
        decode(payload[:cut].clone(), layout.shapes, layout.block_size)
    flipped = payload.clone()
    position = data.draw(st.integers(0, payload.numel() - 1))
    flipped[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CodecError):
        decode(flipped, layout.shapes)


def _resealed(body: bytes) -> torch.Tensor:
    """A payload with a valid checksum over ``body``: corruption the checksum cannot see."""
    return torch.frombuffer(bytearray(body + struct.pack("<I", zlib.crc32(body))), dtype=torch.uint8)


def test_well_sealed_but_inconsistent_payloads_are_rejected():
    layout = BlockLayout([(3, 2)])
    body = bytes(encode(torch.arange(6.0), layout, [torch.tensor([1])]).numpy())[:-4]
    with pytest.raises(CodecError, match="version 3"):
        decode(_resealed(body[:4] + b"\x03" + body[5:]))
    with pytest.raises(CodecError, match="magic"):
        decode(_resealed(b"XXXX" + body[4:]))
    with pytest.raises(CodecError, match="dtype code"):
        decode(_resealed(body[:5] + b"\x09" + body[6:]))
    with pytest.raises(CodecError, match="value bytes"):
        decode(_resealed(body[:-4]))                        # one value short
    runs_at = 4 + 1 + 1 + 2 + 4 + 1 + 2 * 4 + 4                 # header, ndim, shape, run count
    with pytest.raises(CodecError, match="runs cover"):
        decode(_resealed(body[:runs_at] + struct.pack("<II", 3, 1) + body[runs_at + 8:]))
    with pytest.raises(CodecError, match="expected"):
        decode(encode(torch.arange(6.0), layout, [torch.tensor([1])]), [(2, 3)])
    with pytest.raises(CodecError, match="uint8"):
        decode(torch.zeros(4))


def test_a_payload_cut_in_other_blocks_is_rejected():
    layout = BlockLayout([(4, 8)], block_size=16)
    payload = encode(torch.arange(32.0), layout, [torch.tensor([1])])
    assert torch.equal(decode(payload, [(4, 8)], 16)[16:], torch.arange(16.0, 32.0))
    with pytest.raises(CodecError, match="blocks of 16, expected 0"):
        decode(payload, [(4, 8)])
