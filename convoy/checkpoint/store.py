"""A checkpoint file mapped into memory: two areas, slot writes, flushes and commit records.

On a DAX file system writes go straight into the mapping (a memory copy to
persistent memory) and are made durable with ``msync`` of just the pages
written; elsewhere they are ``pwrite`` + ``fdatasync``. Reads are views of the mapping. The file is created at its full size up
front (``posix_fallocate``) so a full disk is reported before training, not in
the middle of a checkpoint.

Example::

    >>> store = Store.create(path, layout)
    >>> store.invalidate(area=1)
    >>> store.write_slot(1, 0, staged_bytes, generation=1)
    >>> store.commit(1, CommitRecord(1, step=5, epoch=0, position=5, checksums=[crc]))
"""
from __future__ import annotations

import errno
import mmap
from concurrent.futures import ThreadPoolExecutor
import os
import warnings
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from convoy.checkpoint import faults
from convoy.checkpoint.fsinfo import fs_info
from convoy.checkpoint.format import (PAGE, RECORD_BYTES, CommitRecord, FormatError, Layout, Slot, align,
                                      checksum_function, dtype_of, fold_page_sums, pack_superblock, page_sums,
                                      unpack_superblock)
from convoy.utils.atomic import sync_folder

AREAS = 2
AREA_NAMES = "AB"


class Store:
    """One checkpoint file. Use :meth:`create` or :meth:`open`, not the constructor."""

    def __init__(self, path: Path, layout: Layout, header: int, fd: int, writable: bool):
        self.path = path
        self.layout = layout
        self.header = header
        self.writable = writable
        self._fd = fd
        self.size = os.fstat(fd).st_size
        # On DAX the mapping is persistent memory: stores plus msync (a cache flush) persist.
        # Elsewhere, stores into a shared file mapping page-fault on every page after each
        # write-back; pwrite + fdatasync moves the same bytes without the faults.
        self.dax = fs_info(path).dax
        self._mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ) \
            if self.size else None
        self._staging: mmap.mmap | None = None   # _write_staged's page-aligned buffer, reused
        self._direct_fd: int | None = None       # the file opened with O_DIRECT (-1: not possible here)

    @property
    def expected_size(self) -> int:
        return self.header + AREAS * self.layout.area_size()

    # ---------------------------------------------------------------- opening
    @classmethod
    def create(cls, path: str | Path, layout: Layout) -> "Store":
        """Make a new file (replacing any old one atomically) with both areas empty.

        Raises:
            OSError: the directory is not writable, or the disk has no room (ENOSPC).
        """
        path = Path(path)
        superblock = pack_superblock(layout)
        size = len(superblock) + AREAS * layout.area_size()
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)   # reserve every block now: ENOSPC here, not mid-run
            os.pwrite(fd, superblock, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)
        sync_folder(path.parent)
        return cls.open(path, writable=True)

    @classmethod
    def open(cls, path: str | Path, writable: bool = False) -> "Store":
        """Map an existing file; a writable open restores a truncated file to full size.

        Raises:
            FormatError: not a convoy checkpoint, or its header is damaged.
        """
        path = Path(path)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            head = os.pread(fd, PAGE, 0)
            layout, header = unpack_superblock(head, lambda off, n: os.pread(fd, n, off))
            expected = header + AREAS * layout.area_size()
            if writable and os.fstat(fd).st_size < expected:
                os.posix_fallocate(fd, 0, expected)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, layout, header, fd, writable)

    def close(self) -> None:
        self._close_direct()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a tensor view; the mapping goes with it
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---------------------------------------------------------------- writing
    def _area_offset(self, area: int) -> int:
        return self.header + area * self.layout.area_size()

    def invalidate(self, area: int) -> None:
        """Erase ``area``'s commit record (durably) before its slots are overwritten."""
        offset = self._area_offset(area)
        self._write(offset, b"\0" * 8)
        self._sync(offset, 8)

    def write_slot(self, area: int, index: int, data: memoryview, generation: int) -> None:
        """Copy ``data`` (the slot's raw bytes) into ``area`` and flush it to the medium."""
        slot = self.layout.slots[index]
        if len(data) != slot.nbytes:
            raise ValueError(f"slot {slot.name!r} takes {slot.nbytes} bytes, got {len(data)}")
        start = self._area_offset(area) + slot.offset
        half = len(data) // 2
        self._write(start, data[:half])
        faults.halfway("slot", generation, index)
        self._write(start + half, data[half:])
        self._sync(start, len(data))

    def write_tensors(self, area: int, index: int, tensors: list[torch.Tensor], generation: int,
                      read: Callable[[], None] | None = None) -> int:
        """Write slot ``index`` of ``area`` from ``tensors`` (its layout order); return its checksum
        (the function the layout names). Nothing is flushed: call :meth:`flush` once every slot
        of the step is written.

        Where the file is checked by page sums (a rank file) and takes ``O_DIRECT``
        writes (ext4, xfs: not tmpfs, not DAX), the slot is copied into a page-aligned
        staging buffer that stays in memory, checked there, and written with one
        ``O_DIRECT`` write (:meth:`write_image` writes memory that already is the slot): the
        bytes go to the disk without a second copy into the page cache, without
        faulting in page-cache pages (costly on a new file), and without dirty
        pages for the kernel to write back. Elsewhere the slot is written straight
        from the tensors' own memory (one ``pwritev`` per half slot, or stores into
        a DAX mapping), zero padding included; the bytes and the checksum are the
        same either way. ``read`` is called once ``tensors`` are no longer needed:
        when staged, as soon as they are copied, before the check and the write.
        """
        slot = self.layout.slots[index]
        parts = _slot_parts(slot, tensors)
        # Staged O_DIRECT writes pay off for files rewritten whole every step (a rank's residuals,
        # checked by page sums); a model file's layers go through the page cache, which measured
        # cheaper for them (resnet18 every step: +1.0-1.7% against +1.8-6.5% staged).
        if self.dax or self.layout.checksum != "pagesum" or self._direct() < 0:
            checksum = self._write_in_place(area, index, parts, generation)
            if read is not None:
                read()
            return checksum
        return self._write_staged(area, index, parts, generation, read)

    def _write_in_place(self, area: int, index: int, parts: list[memoryview], generation: int) -> int:
        slot = self.layout.slots[index]
        start = self._area_offset(area) + slot.offset
        half = len(parts) // 2
        written = self._write_parts(start, parts[:half])
        faults.halfway("slot", generation, index)
        self._write_parts(start + written, parts[half:])
        if self.layout.checksum == "crc32":   # over the sources: no second pass over the file
            checksum = 0
            for part in parts:
                checksum = zlib.crc32(part, checksum)
            return checksum
        return checksum_function(self.layout.checksum)(self.slot_bytes(area, index))

    def _write_staged(self, area: int, index: int, parts: list[memoryview], generation: int,
                      read: Callable[[], None] | None) -> int:
        slot = self.layout.slots[index]
        length = align(slot.nbytes)   # slots start on a page and the area holds whole pages
        view = memoryview(self._staging_buffer(length))[:length]
        parts = parts + [memoryview(bytes(length - slot.nbytes))]   # the buffer held another slot before
        if self.layout.checksum == "pagesum":
            sums = _copy_summing(parts, view)
        else:
            _copy(parts, view, 0, length)
        if read is not None:
            read()   # the tensors may change from here on: the check and the write read the copy
        if self.layout.checksum == "pagesum":
            checksum = fold_page_sums(sums[:-(-slot.nbytes // PAGE)])
        else:
            checksum = checksum_function(self.layout.checksum)(view[:slot.nbytes])
        self._write_aligned(area, index, view, generation)
        view.release()
        return checksum

    def can_write_images(self) -> bool:
        """Whether :meth:`write_image` applies: page sums, ``O_DIRECT`` possible, no DAX."""
        return not self.dax and self.layout.checksum == "pagesum" and self._direct() >= 0

    def write_image(self, area: int, index: int, image: memoryview, generation: int) -> int:
        """Write slot ``index`` of ``area`` from ``image``: page-aligned memory that already holds
        the slot's bytes as the file does (zero padding included, to a whole page); return its
        page sum. One pass over the image (the sum) and one ``O_DIRECT`` write: no copy."""
        slot = self.layout.slots[index]
        length = align(slot.nbytes)
        view = image[:length]
        checksum = fold_page_sums(page_sums(view)[:-(-slot.nbytes // PAGE)])
        self._write_aligned(area, index, view, generation)
        view.release()
        return checksum

    def _write_aligned(self, area: int, index: int, view: memoryview, generation: int) -> None:
        length = len(view)
        start = self._area_offset(area) + self.layout.slots[index].offset
        # Each O_DIRECT write waits for the disk, and the persister, at the lowest priority, then
        # waits for a free core: one write per slot, split in two only for a crash test's kill point.
        half = length // 2 // PAGE * PAGE if faults.armed() else length
        self._write_direct(start, view[:half])
        faults.halfway("slot", generation, index)
        self._write_direct(start + half, view[half:])

    def _staging_buffer(self, length: int) -> mmap.mmap:
        if self._staging is None or len(self._staging) < length:
            if self._staging is not None:
                self._staging.close()
            # Anonymous memory is page-aligned, as O_DIRECT needs; as large as the largest slot,
            # so that it is faulted in once.
            largest = max([align(slot.nbytes) for slot in self.layout.slots] + [length, PAGE])
            self._staging = mmap.mmap(-1, largest)
            if hasattr(mmap, "MADV_HUGEPAGE"):     # fewer page faults the first time it is filled
                self._staging.madvise(mmap.MADV_HUGEPAGE)
        return self._staging

    def _write_direct(self, offset: int, data: memoryview) -> None:
        """Write page-aligned ``data`` at page-aligned ``offset`` with O_DIRECT (what a short
        write leaves, or a write the file system refuses after all, through the page cache)."""
        done = 0
        try:
            while done < len(data):
                wrote = os.pwrite(self._direct(), data[done:], offset + done)
                done += wrote
                if wrote % PAGE or not wrote:
                    break
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._close_direct()
            self._direct_fd = -1   # the file system took the flag but not the write: never again
        if done < len(data):
            write_all(self._fd, [data[done:]], offset + done)

    def _direct(self) -> int:
        """The file opened with O_DIRECT for writing; -1 where that is not possible."""
        if self._direct_fd is None:
            try:
                self._direct_fd = os.open(self.path, os.O_RDWR | os.O_DIRECT) if hasattr(os, "O_DIRECT") else -1
            except OSError:   # tmpfs and others refuse O_DIRECT
                self._direct_fd = -1
        return self._direct_fd

    def _close_direct(self) -> None:
        if self._direct_fd is not None and self._direct_fd >= 0:
            os.close(self._direct_fd)
        self._direct_fd = None

    def _write_parts(self, offset: int, parts: list[memoryview]) -> int:
        total = sum(len(p) for p in parts)
        if self.dax:
            for part in parts:
                self._mm[offset:offset + len(part)] = part
                offset += len(part)
            return total
        write_all(self._fd, parts, offset)
        return total

    def flush(self, area: int) -> None:
        """Make every slot written into ``area`` durable (one fdatasync, or msync of the area)."""
        self._sync(self._area_offset(area) + RECORD_BYTES, self.layout.area_size() - RECORD_BYTES)

    def commit(self, area: int, record: CommitRecord) -> None:
        """Write ``record`` into ``area`` and flush it: the area now holds a recoverable step."""
        raw = record.pack()
        start = self._area_offset(area)
        half = len(raw) // 2
        # The 8-byte magic goes last: a write cut short anywhere leaves no record, never a torn one.
        self._write(start + half, raw[half:])
        faults.halfway("record", record.generation)
        self._write(start + 8, raw[8:half])
        self._write(start, raw[:8])
        self._sync(start, len(raw))

    def _write(self, offset: int, data: bytes | memoryview) -> None:
        if self.dax:
            self._mm[offset:offset + len(data)] = data
        else:
            os.pwrite(self._fd, data, offset)

    def _sync(self, offset: int, length: int) -> None:
        """Make ``length`` bytes at ``offset`` durable: msync of those pages, or fdatasync."""
        if self.dax:
            begin = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            self._mm.flush(begin, align(offset + length) - begin)
        else:
            os.fdatasync(self._fd)

    # ---------------------------------------------------------------- reading
    def record(self, area: int) -> CommitRecord:
        """The commit record of ``area``; FormatError when there is none or it is damaged."""
        start = self._area_offset(area)
        if self._mm is None or start + RECORD_BYTES > len(self._mm):
            raise FormatError("the file is truncated before this area's commit record")
        return CommitRecord.unpack(memoryview(self._mm)[start:start + RECORD_BYTES])

    def committed_steps(self) -> list[int]:
        """Steps of the areas whose commit record is intact (slot checksums not checked)."""
        steps = []
        for area in range(AREAS):
            try:
                steps.append(self.record(area).step)
            except FormatError:
                pass
        return steps

    def slot_bytes(self, area: int, index: int) -> memoryview:
        slot = self.layout.slots[index]
        start = self._area_offset(area) + slot.offset
        if self._mm is None or start + slot.nbytes > len(self._mm):
            raise FormatError(f"the file is truncated inside layer {slot.name!r}")
        return memoryview(self._mm)[start:start + slot.nbytes]

    def verify(self, area: int) -> CommitRecord:
        """The record of ``area`` after checking every slot's checksum; FormatError names the bad one."""
        record = self.record(area)
        if len(record.checksums) != len(self.layout.slots):
            raise FormatError("commit record has the wrong number of checksums")
        views = [self.slot_bytes(area, index) for index in range(len(record.checksums))]
        # zlib and numpy release the GIL on large buffers: the layers are checked in parallel.
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            sums = list(pool.map(checksum_function(self.layout.checksum), views))
        for index, (got, expected) in enumerate(zip(sums, record.checksums)):
            if got != expected:
                raise FormatError(f"layer {self.layout.slots[index].name!r} checksum mismatch")
        return record

    def tensors(self, area: int, index: int) -> dict[str, torch.Tensor]:
        """Views (no copy) of slot ``index``'s tensors in ``area``, by key; copy before the store closes."""
        slot: Slot = self.layout.slots[index]
        raw = self.slot_bytes(area, index)
        out = {}
        for t in slot.tensors:
            dtype = dtype_of(t.dtype)
            count = t.nbytes // torch.empty(0, dtype=dtype).element_size()
            with warnings.catch_warnings():  # read-only mappings are fine: callers only copy out
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(raw, dtype=dtype, count=count, offset=t.offset) if count else \
                    torch.empty(0, dtype=dtype)
            out[t.key] = flat.view(t.shape)
        return out


def area_name(area: int) -> str:
    return AREA_NAMES[area]


_ZEROS = bytes(64)   # the padding after a tensor is < 64 bytes (tensors are 64-byte aligned)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a tensor (any dtype, also 0-dim), without a copy where it is a contiguous CPU one."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


_SUM_CHUNK = 256 * 1024   # copied, then summed while it is still in the cache


def _copy_summing(parts: list[memoryview], out: memoryview) -> np.ndarray:
    """Copy ``parts`` one after the other into ``out`` (their total length, whole pages) and
    return its :func:`page_sums`, each chunk summed right after it is copied."""
    sums = np.empty(len(out) // PAGE, dtype=np.uint64)
    for start in range(0, len(out), _SUM_CHUNK):
        end = min(start + _SUM_CHUNK, len(out))
        _copy(parts, out, start, end)
        page_sums(out[start:end], sums[start // PAGE:])
    return sums


def _copy(parts: list[memoryview], out: memoryview, start: int, end: int) -> None:
    """Copy bytes ``start:end`` of the concatenation of ``parts`` to the same place in ``out``."""
    offset = 0
    for part in parts:
        lo, hi = max(start, offset), min(end, offset + len(part))
        if lo < hi:
            out[lo:hi] = part[lo - offset:hi - offset]
        offset += len(part)
        if offset >= end:
            return


def _slot_parts(slot: Slot, tensors: list[torch.Tensor]) -> list[memoryview]:
    """The bytes of ``slot`` in order: each tensor's own memory, then the zeros up to the next
    tensor (or the slot's end)."""
    parts: list[memoryview] = []
    ends = [spec.offset for spec in slot.tensors[1:]] + [slot.nbytes]
    for spec, tensor, end in zip(slot.tensors, tensors, ends):
        raw = raw_bytes(tensor)
        if len(raw) != spec.nbytes:
            raise ValueError(f"slot {slot.name!r}: {spec.key} has {len(raw)} bytes, the layout {spec.nbytes}")
        parts += [raw, memoryview(_ZEROS)[:end - spec.offset - spec.nbytes]]
    return parts


def write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """Write ``parts`` one after the other at ``offset`` of ``fd``: one ``pwritev``, more when
    it writes less than asked (signals, huge slots)."""
    total, done = sum(len(p) for p in parts), 0
    while done < total:
        wrote = os.pwritev(fd, parts, offset + done)
        done += wrote
        if done < total:
            parts = _skip(parts, wrote)


def _skip(parts: list[memoryview], count: int) -> list[memoryview]:
    """``parts`` without their first ``count`` bytes."""
    out = []
    for part in parts:
        if count >= len(part):
            count -= len(part)
            continue
        out.append(part[count:])
        count = 0
    return out
