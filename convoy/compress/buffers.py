"""Gradient-sized buffers an error-feedback memory reuses from step to step.

A memory replaces its residuals (and velocities) by new tensors every step and
never writes into one it has kept, so a checkpoint may hold a reference to one
as its snapshot (``Memory.replaced_each_step``). Fresh tensors the size of a
bucket cost a page fault per 4 KiB every step, as much CPU as a pass over them;
:class:`Spares` keeps the buffers the memory replaced and hands them out again,
except those a snapshot may hold: :meth:`Spares.lend` (called when the memory's
state is handed out) takes those out of reuse for good.
"""
from __future__ import annotations

import threading
from typing import Iterable

import torch


class Spares:
    """Buffers made for a memory's tensors, by key (``residual.3``), reused once released.

    A buffer is *owned* from :meth:`take` until it is lent or forgotten; only an
    owned buffer is ever handed out again, after :meth:`release`. The memory's
    thread takes and releases; :meth:`lend` may come from a checkpoint's thread,
    hence the lock.

    Example::

        >>> spares = Spares()
        >>> new = spares.take("velocity.0", grad)           # a new buffer (none released yet)
        >>> spares.release("velocity.0", old)              # old is not used any more
        >>> spares.lend(memory.kept_tensors())             # a snapshot holds these: never reused
    """

    def __init__(self) -> None:
        self._owned: dict[int, tuple[str, torch.Tensor]] = {}   # id -> (key, buffer)
        self._free: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like ``like`` for ``key``: one released under ``key``, else a new one."""
        with self._lock:
            free = self._free.get(key)
            while free:
                buffer = free.pop()
                if self._owned.get(id(buffer), (None, None))[1] is not buffer:
                    continue   # lent after it was released: a snapshot holds it
                if buffer.shape == like.shape and buffer.dtype == like.dtype and buffer.device == like.device:
                    return buffer
                del self._owned[id(buffer)]   # the layout changed: let it go
            buffer = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self._owned[id(buffer)] = (key, buffer)
            return buffer

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a buffer taken here and neither lent nor dropped."""
        with self._lock:
            return self._owned.get(id(tensor), (None, None))[1] is tensor

    def release(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor`` is not used any more: reuse it for ``key`` if it is owned (else nothing)."""
        with self._lock:
            if self._owned.get(id(tensor), (None, None))[1] is tensor:
                self._free.setdefault(key, []).append(tensor)

    def drop(self, tensor: torch.Tensor) -> None:
        """Never reuse ``tensor`` (someone else may still read it): it is freed with its last reference."""
        with self._lock:
            if self._owned.get(id(tensor), (None, None))[1] is tensor:
                del self._owned[id(tensor)]

    def lend(self, tensors: Iterable[torch.Tensor]) -> None:
        """References to ``tensors`` were handed out (a snapshot): never reuse them."""
        with self._lock:
            for tensor in tensors:
                if self._owned.get(id(tensor), (None, None))[1] is tensor:
                    del self._owned[id(tensor)]

    def forget(self, suffix: str) -> None:
        """Drop the buffers of the keys ``<kind>.<suffix>`` (a layer whose layout changed)."""
        with self._lock:
            for key in [k for k in self._free if k.split(".", 1)[1] == suffix]:
                del self._free[key]
            for ident in [i for i, (k, _) in self._owned.items() if k.split(".", 1)[1] == suffix]:
                del self._owned[ident]

    def clear(self) -> None:
        """Drop every buffer (the memory's state was replaced)."""
        with self._lock:
            self._owned.clear()
            self._free.clear()
