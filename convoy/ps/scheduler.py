"""The sender's scheduler: a priority queue of ready slices and a credit window (ByteScheduler).

Ready slices wait in a priority queue; one thread issues the head while the
bytes in flight stay within the credit, another waits for issued sends to
complete and returns their credit. A slice that becomes ready while others
wait therefore goes ahead of every queued slice of lower priority: preemption
at slice granularity (a send already issued is never taken back). In FIFO
mode the queue is ordered by arrival alone.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from convoy.core import POLL_S, wait_until
from convoy.ps.wire import HEADER_BYTES, HEADER_TAG, RING, STOP, header, payload_tag


class TransferError(RuntimeError):
    """A send to a peer failed (the peer died or stopped answering)."""


@dataclass(eq=False)
class Transfer:
    """One slice (or a stream's stop mark) for one peer on one channel.

    ``priority`` sorts the queue, smallest first; ``payload`` must stay
    unchanged until the send completes.
    """

    peer: int
    group: dist.ProcessGroup
    channel: int
    slice_id: int
    step: int
    payload: torch.Tensor | None
    priority: tuple = ()

    @property
    def nbytes(self) -> int:
        payload = 0 if self.payload is None else self.payload.numel() * self.payload.element_size()
        return HEADER_BYTES + payload


def stop_marks(peer: int, group: dist.ProcessGroup, channel: int) -> list[Transfer]:
    """The transfers that end a channel's stream (one per posted header receive); they sort last."""
    return [Transfer(peer, group, channel, STOP, 0, None, (float("inf"),)) for _ in range(RING)]


@dataclass(order=True)
class _Queued:
    key: tuple
    transfer: Transfer = field(compare=False)


class SliceScheduler:
    """Sends transfers in priority order with at most ``credit_bytes`` in flight.

    Args:
        credit_bytes: bytes issued but not yet completed, at most; ``None``: no
            limit. One transfer is always allowed, however large.
        fifo: order by submission alone, ignoring priorities.
        on_sent: called with (transfer, issue time, completion time) from the
            completion thread (timelines, byte counts).
        record: keep ``issued``, the transfers in the order they were issued (tests).

    Example::

        >>> scheduler = SliceScheduler(credit_bytes=1 << 20)
        >>> scheduler.submit([Transfer(1, group, 0, slice_id=0, step=0, payload=t, priority=(0, 0))])
        >>> scheduler.close()
    """

    def __init__(self, credit_bytes: int | None = None, fifo: bool = False,
                 on_sent: Callable[[Transfer, float, float], None] | None = None, record: bool = False,
                 name: str = "convoy-ps-send"):
        if credit_bytes is not None and credit_bytes <= 0:
            raise ValueError(f"credit_bytes must be > 0, got {credit_bytes}")
        self.credit_bytes, self.fifo = credit_bytes, fifo
        self._on_sent = on_sent
        self.issued: list[Transfer] | None = [] if record else None
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._in_flight: deque = deque()
        self._in_flight_bytes = 0
        # Popped from the queue but not yet in _in_flight: without counting
        # these, drain() could return (and the caller drop the payloads) while
        # a send is being issued, and that send would never complete.
        self._issuing = 0
        self._counter = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guard(self._issue_loop), name=name, daemon=True),
                         threading.Thread(target=self._guard(self._complete_loop), name=name + "-done",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    # -------------------------------------------------------------- callers
    def submit(self, transfers: Iterable[Transfer]) -> None:
        """Queue ready transfers; they go out by priority as credit allows."""
        with self._cond:
            self._raise_if_failed()
            for transfer in transfers:
                order = next(self._counter)
                key = (order,) if self.fifo and transfer.slice_id != STOP else (*transfer.priority, order)
                heapq.heappush(self._queue, _Queued(key, transfer))
            self._cond.notify_all()

    def drain(self) -> None:
        """Block until every submitted transfer has completed."""
        wait_until(self._cond, lambda: not (self._queue or self._issuing or self._in_flight) or self.error is not None)
        with self._cond:
            self._raise_if_failed()

    def close(self) -> None:
        """Drain, then stop the threads."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            for thread in self._threads:
                thread.join(timeout=5 * POLL_S)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise TransferError(str(self.error)) from self.error

    # -------------------------------------------------------------- threads
    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # callers re-raise it
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
        return run

    def _may_issue(self) -> bool:
        if not self._queue:
            return False
        if self.credit_bytes is None or not (self._in_flight or self._issuing):
            return True
        return self._in_flight_bytes + self._queue[0].transfer.nbytes <= self.credit_bytes

    def _issue_loop(self) -> None:
        while True:
            with self._cond:
                while not self._may_issue():
                    if self._stopping or self.error is not None:
                        return
                    self._cond.wait(POLL_S)
                transfer = heapq.heappop(self._queue).transfer
                self._in_flight_bytes += transfer.nbytes
                self._issuing += 1
            issued_at = time.time()
            # The payload first: its receive is posted already, so its bytes
            # flow at once; the header tells the receiver it is coming.
            works = []
            try:
                if transfer.payload is not None:
                    works.append(dist.isend(transfer.payload, transfer.peer, group=transfer.group,
                                            tag=payload_tag(transfer.slice_id)))
                works.append(dist.isend(header(transfer.slice_id, transfer.step), transfer.peer,
                                        group=transfer.group, tag=HEADER_TAG))
            except RuntimeError as exc:
                raise TransferError(f"sending to rank {transfer.peer} failed: {exc}") from exc
            with self._cond:
                if self.issued is not None:
                    self.issued.append(transfer)
                self._in_flight.append((transfer, works, issued_at))
                self._issuing -= 1
                self._cond.notify_all()

    def _complete_loop(self) -> None:
        while True:
            with self._cond:
                while not self._in_flight:
                    if self._stopping or self.error is not None:
                        return
                    self._cond.wait(POLL_S)
                transfer, works, issued_at = self._in_flight[0]
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:
                raise TransferError(f"sending to rank {transfer.peer} failed: {exc}") from exc
            done_at = time.time()
            with self._cond:
                self._in_flight.popleft()
                self._in_flight_bytes -= transfer.nbytes
                self._cond.notify_all()
            if self._on_sent is not None:
                self._on_sent(transfer, issued_at, done_at)
