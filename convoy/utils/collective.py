"""An asynchronous collective whose tensors outlive the backend's hold on them.

gloo completes a collective on one of its own threads and drops its handle (and
with it the tensors the collective used) on that thread a moment later. A
tensor made in Python whose Python object is dropped while gloo still holds it
is handed to C++ with its Python object kept alive, so gloo's final release
must take the interpreter's lock: if that happens while the interpreter exits,
gloo's thread is ended inside a C++ destructor and the process aborts
("terminate called without an active exception"). This was seen at exit in one
run in about forty of a two-process DDP job with convoy's fp16 hook.

:class:`AsyncCollective` keeps the Python side of the collective (its handle
and one of its tensors) until gloo has let go of the tensor: its use count,
read before the collective was issued, is back to where it was. Only then may
the caller drop its references, on a thread that holds the interpreter.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

# How long ``wait`` waits for the backend to let go of a completed collective's
# tensors (it does so microseconds after completing it, unless descheduled).
RELEASE_TIMEOUT_S = 10.0


class AsyncCollective:
    """A started collective on ``tensor``: wait for it, then for the backend to drop its hold.

    Args:
        tensor: one tensor the collective reads or writes, made and kept by the caller.
        issue: starts the collective (``async_op=True``) and returns its work handle.

    Example::

        >>> sent = AsyncCollective(wire, lambda: dist.all_reduce(wire, async_op=True))
        >>> sent.wait()   # wire holds the sum; gloo no longer holds wire
    """

    __slots__ = ("_tensor", "_uses", "_work")

    def __init__(self, tensor: torch.Tensor, issue: Callable[[], Any]):
        self._tensor = tensor
        self._uses = tensor._use_count()
        self._work = issue()

    def is_completed(self) -> bool:
        """Whether the collective has completed (``wait`` then returns at once, or nearly)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        """Wait for the collective, drop its handle, then wait until the backend has dropped its own."""
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while self._tensor._use_count() > self._uses and time.monotonic() < deadline:
            time.sleep(0)   # gloo's thread needs no interpreter lock to finish: let it run
