"""Slot writes and slot checks of a checkpoint file: the page-sum check, and the staged O_DIRECT
write against the write from the tensors' own memory (real files)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.checkpoint.format import PAGE, CommitRecord, FormatError, Layout, Slot, TensorSpec, checksum_function, pagesum
from convoy.checkpoint.store import Store

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8]


@st.composite
def pages_of_words(draw):
    """Random bytes, a multiple of 8 long: whole pages and maybe a partial last one."""
    pages, tail = draw(st.integers(1, 4)), draw(st.integers(0, PAGE // 8 - 1))
    rng = random.Random(draw(st.integers(0, 2**32)))
    return bytearray(rng.randbytes(pages * PAGE + 8 * tail))


@settings(max_examples=200, deadline=None)
@given(pages_of_words(), st.data())
def test_pagesum_sees_every_flipped_bit(data, draw):
    before = pagesum(bytes(data))
    data[draw.draw(st.integers(0, len(data) - 1))] ^= 1 << draw.draw(st.integers(0, 7))
    assert pagesum(bytes(data)) != before


@settings(max_examples=100, deadline=None)
@given(pages_of_words(), st.data())
def test_pagesum_sees_a_page_written_in_another_ones_place_or_left_stale(data, draw):
    whole = len(data) // PAGE
    if whole < 2:
        return
    a, b = draw.draw(st.lists(st.integers(0, whole - 1), min_size=2, max_size=2, unique=True))
    swapped = bytearray(data)
    swapped[a * PAGE:(a + 1) * PAGE], swapped[b * PAGE:(b + 1) * PAGE] = data[b * PAGE:(b + 1) * PAGE], \
        data[a * PAGE:(a + 1) * PAGE]
    stale = bytearray(data)
    stale[a * PAGE:(a + 1) * PAGE] = bytes(PAGE)   # a lost write: the page as it was before
    assert len({pagesum(bytes(data)), pagesum(bytes(swapped)), pagesum(bytes(stale))}) == 3


def test_pagesum_counts_a_partial_last_page_as_padded_with_zeros():
    data = random.Random(3).randbytes(PAGE + 40)
    assert pagesum(data) == pagesum(data + bytes(PAGE - 40))


@st.composite
def slots(draw):
    """Two slots of tensors of drawn dtypes and sizes (0-dim and empty included), their data,
    and the slot check; the first slot is the larger (up to several of the chunks the staged
    write copies and sums at a time), so the second is staged after it."""
    rng = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    made = []
    for biggest in (80_000, 600):
        tensors = []
        for _ in range(draw(st.integers(1, 4))):
            dtype = draw(st.sampled_from(DTYPES))
            shape = draw(st.sampled_from([(), (0,), (draw(st.integers(1, biggest)),), (3, draw(st.integers(1, 50)))]))
            tensors.append((torch.rand(shape, generator=rng) * 100).to(dtype))
        made.append(tensors)
    return made, draw(st.sampled_from(["pagesum", "crc32"]))


def _write(path, layout, tensors, direct: bool) -> list[bytes]:
    """Write every slot into area 1 and commit; return each slot's bytes as stored."""
    store = Store.create(path, layout)
    if not direct:
        store._direct_fd = -1   # as on tmpfs, which refuses O_DIRECT
    store.invalidate(1)
    sums = [store.write_tensors(1, i, slot, generation=1) for i, slot in enumerate(tensors)]
    store.flush(1)
    store.commit(1, CommitRecord(1, 1, 0, 1, sums))
    store.close()
    reopened = Store.open(path)
    try:
        assert reopened.verify(1).checksums == sums
        assert sums == [checksum_function(layout.checksum)(reopened.slot_bytes(1, i)) for i in range(len(sums))]
        for i, slot in enumerate(tensors):
            for spec, tensor in zip(layout.slots[i].tensors, slot):
                assert torch.equal(reopened.tensors(1, i)[spec.key], tensor)
        return [bytes(reopened.slot_bytes(1, i)) for i in range(len(sums))]
    finally:
        reopened.close()


def _same_either_way(directory, tensors: list[list[torch.Tensor]], checksum: str) -> None:
    layout = Layout("rank", [Slot(f"s{i}", [TensorSpec.of(f"t{j}", t) for j, t in enumerate(slot)])
                             for i, slot in enumerate(tensors)], {"checksum": checksum})
    assert _write(directory / "direct.ckpt", layout, tensors, True) == \
        _write(directory / "in_place.ckpt", layout, tensors, False)


@settings(max_examples=25, deadline=None)
@given(slots())
def test_the_staged_write_stores_the_bytes_and_check_of_the_write_from_the_tensors(tmp_path_factory, case):
    _same_either_way(tmp_path_factory.mktemp("slots"), *case)


@pytest.mark.parametrize("checksum", ["pagesum", "crc32"])
def test_tensors_that_straddle_the_staged_writes_chunks_are_stored_whole(tmp_path, checksum):
    rng = torch.Generator().manual_seed(5)
    big = [torch.randn(100_003, dtype=torch.float64, generator=rng), torch.arange(5, dtype=torch.uint8),
           torch.randn(70_001, generator=rng), torch.randn(3, 333, generator=rng).half()]
    _same_either_way(tmp_path, [big, [torch.randn(17, generator=rng)]], checksum)


def test_a_changed_residual_byte_fails_the_page_sum_of_its_area(tmp_path):
    residual = torch.randn(100_000)
    layout = Layout("rank", [Slot("state", [TensorSpec.of("sync.residual.0", residual)])], {"checksum": "pagesum"})
    store = Store.create(tmp_path / "r.ckpt", layout)
    store.invalidate(0)
    store.commit(0, CommitRecord(1, 1, 0, 1, [store.write_tensors(0, 0, [residual], 1)]))
    offset = store.header + layout.slots[0].offset + 4 * 77_777
    store.close()
    with open(tmp_path / "r.ckpt", "r+b") as f:
        f.seek(offset)
        word = f.read(4)
        f.seek(offset)
        f.write(bytes([word[0] ^ 0x10]) + word[1:])
    reopened = Store.open(tmp_path / "r.ckpt")
    with pytest.raises(FormatError, match="checksum mismatch"):
        reopened.verify(0)
    reopened.close()


def test_files_that_name_no_check_are_read_with_crc32():
    assert Layout("rank", [], {}).checksum == "crc32"
    assert Layout.from_json(Layout("rank", [], {"checksum": "pagesum"}).to_json()).checksum == "pagesum"


def test_a_write_the_file_system_refuses_with_o_direct_goes_through_the_page_cache(tmp_path):
    """Memory that is not page-aligned is refused by O_DIRECT (EINVAL) on ext4 and xfs: the
    bytes still land, and the store writes from the tensors from then on."""
    tensor = torch.randn(3000)
    layout = Layout("rank", [Slot("state", [TensorSpec.of("x", tensor)])], {"checksum": "pagesum"})
    store = Store.create(tmp_path / "r.ckpt", layout)
    if store._direct() < 0:
        pytest.skip("this file system refuses O_DIRECT altogether (tmpfs)")
    unaligned = memoryview(bytearray(PAGE + 1))[1:]
    unaligned[:] = random.Random(1).randbytes(PAGE)
    start = store._area_offset(0) + layout.slots[0].offset
    store._write_direct(start, unaligned)
    assert store._direct_fd == -1 and bytes(store.slot_bytes(0, 0)[:PAGE]) == bytes(unaligned)
    store.invalidate(1)
    store.commit(1, CommitRecord(1, 1, 0, 1, [store.write_tensors(1, 0, [tensor], 1)]))
    assert store.verify(1).step == 1 and torch.equal(store.tensors(1, 0)["x"], tensor)
    store.close()


@pytest.mark.parametrize("checksum", ["pagesum", "crc32"])
def test_a_layer_changed_once_the_store_has_read_it_is_stored_as_it_was(tmp_path, checksum):
    """The persister releases a layer to its next update as soon as the store calls ``read``:
    what changes after that must not reach the file nor its check."""
    weight = torch.randn(70_001)
    before = weight.clone()
    layout = Layout("model", [Slot("fc", [TensorSpec.of("param.weight", weight)])], {"checksum": checksum})
    store = Store.create(tmp_path / "m.ckpt", layout)
    calls = []
    store.invalidate(1)
    crc = store.write_tensors(1, 0, [weight], 1, read=lambda: (calls.append(1), weight.add_(1.0)))
    store.flush(1)
    store.commit(1, CommitRecord(1, 1, 0, 1, [crc]))
    assert calls == [1] and store.verify(1).step == 1
    assert torch.equal(store.tensors(1, 0)["param.weight"], before)
    store.close()
