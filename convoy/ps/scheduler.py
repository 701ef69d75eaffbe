"""The sender's scheduler: a priority queue of ready slices and a credit window per peer (ByteScheduler).

Ready slices wait in a priority queue; one thread issues the most urgent one
whose peer has credit left (the bytes in flight to that peer stay within the
window), and one thread per peer waits for that peer's sends to complete and
returns their credit. A slice that becomes ready while others wait therefore
goes ahead of every queued slice of lower priority: preemption at slice
granularity (a send already issued is never taken back). In FIFO mode the
queue is ordered by arrival alone.

A gloo send completes once its bytes are in the kernel's socket buffer (gloo
sizes it to the message, so every socket holds a slice or two more), not
once the peer has them. Credit returned at completion therefore bounds
nothing on a slow link: the kernel's queues fill with bulk slices and an
urgent slice issued later waits behind them. With ``acked`` the credit comes
back only when the receiver acknowledges the slice
(:class:`~convoy.ps.wire.Receiver` with an ``ack`` group; the transfer's
``ack_group``, a connection that carries nothing else), so the bytes between
the two processes, kernel queues included, stay within the window.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.distributed as dist

from convoy.core import POLL_S, wait_until
if TYPE_CHECKING:
    from convoy.ps.settings import PSSettings
from convoy.ps.wire import HEADER_BYTES, HEADER_TAG, RING, STOP, ack_tag, header, payload_tag


class TransferError(RuntimeError):
    """A send to a peer failed (the peer died or stopped answering)."""


@dataclass(eq=False)
class Transfer:
    """One slice (or a stream's stop mark) for one peer on one channel.

    ``priority`` sorts a step's transfers, smallest first; ``payload`` must stay
    unchanged until the send completes. ``on_sent`` is called with (transfer,
    issue time, completion time) from the completion thread (timelines).
    """

    peer: int
    group: dist.ProcessGroup
    channel: int
    slice_id: int
    step: int
    payload: torch.Tensor | None
    priority: tuple = ()
    on_sent: Callable[["Transfer", float, float], None] | None = None
    ack_group: dist.ProcessGroup | None = None   # where the receiver acknowledges it (an acked scheduler)
    # Credit lane: a lane's window and completions never wait for another lane's. A colocated
    # rank's pushes of a later step, which a peer cannot take before its slot is free, must
    # not hold back the replies that peer needs to get there (bounded staleness deadlocked so).
    lane: int = 0

    @property
    def route(self) -> tuple[int, int]:
        """(peer, lane): what a credit window and a completion thread are kept per."""
        return self.peer, self.lane

    @property
    def nbytes(self) -> int:
        payload = 0 if self.payload is None else self.payload.numel() * self.payload.element_size()
        return HEADER_BYTES + payload


def stop_marks(peer: int, group: dist.ProcessGroup, channel: int) -> list[Transfer]:
    """The transfers that end a channel's stream (one per posted header receive); they sort last."""
    return [Transfer(peer, group, channel, STOP, 0, None) for _ in range(RING)]


@dataclass(order=True)
class _Queued:
    key: tuple
    transfer: Transfer = field(compare=False)


class SliceScheduler:
    """Sends transfers in priority order with at most ``credit_bytes`` in flight to each peer.

    The window is per peer because a peer's link is shared with the other
    senders: a window for all peers at once fills with slices for the busiest
    receiver while the links to the others idle. The queue is one, so the
    most urgent transfer whose peer has room goes first.

    Args:
        credit_bytes: bytes issued to one peer but not yet completed, at most;
            ``None``: no limit. One transfer per peer is always allowed, however large.
        fifo: order by submission alone, ignoring priorities.
        acked: a transfer's credit comes back when its receiver acknowledges it
            on the transfer's ``ack_group``, not when the send completes.
        record: keep ``issued``, the transfers in the order they were issued (tests).

    Example::

        >>> scheduler = SliceScheduler(credit_bytes=1 << 20)
        >>> scheduler.submit([Transfer(1, group, 0, slice_id=0, step=0, payload=t, priority=(0, 0))])
        >>> scheduler.close()
    """

    def __init__(self, credit_bytes: int | None = None, fifo: bool = False, acked: bool = False,
                 record: bool = False, name: str = "convoy-ps-send"):
        if credit_bytes is not None and credit_bytes <= 0:
            raise ValueError(f"credit_bytes must be > 0, got {credit_bytes}")
        self.credit_bytes, self.fifo, self.acked = credit_bytes, fifo, acked
        self.issued: list[Transfer] | None = [] if record else None
        self._name = name
        # One lock; each waiter has its own condition on it, so a completed send wakes the issuing
        # thread and drain(), not every peer's completion thread (on two shared cores a wake-up
        # of every thread per slice cost the job more CPU than its sends).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)         # the issuing thread: work or credit
        self._drained = threading.Condition(self._lock)      # drain(): nothing queued or in flight
        self._route_ready: dict[tuple[int, int], threading.Condition] = {}   # a route's completion thread
        self._queue: list[_Queued] = []   # sorted by key
        self._in_flight: dict[tuple[int, int], deque] = {}   # route -> (transfer, works, issue time), in order
        self._peer_bytes: dict[tuple[int, int], int] = {}    # route -> bytes issued and not yet completed
        # Popped from the queue but not yet in _in_flight: without counting
        # these, drain() could return (and the caller drop the payloads) while
        # a send is being issued, and that send would never complete.
        self._issuing = 0
        self._counter = itertools.count()
        self._stopping = False
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guard(self._issue_loop), name=name, daemon=True)]
        self._threads[0].start()

    @classmethod
    def for_settings(cls, settings: "PSSettings", name: str) -> "SliceScheduler":
        """The job's scheduler: its credit (acknowledged by the receivers when there is one) and order."""
        return cls(settings.credit_bytes, fifo=settings.priority == "fifo", acked=settings.acked, name=name)

    # -------------------------------------------------------------- callers
    def submit(self, transfers: Iterable[Transfer]) -> None:
        """Queue ready transfers; they go out by priority as credit allows."""
        with self._cond:
            self._raise_if_failed()
            for transfer in transfers:
                bisect.insort(self._queue, _Queued(self._key(transfer, next(self._counter)), transfer))
            self._cond.notify()

    def _key(self, transfer: Transfer, order: int) -> tuple:
        """Queue order: stop marks last; FIFO by arrival; otherwise the older step first, then priority.

        The step comes first because one scheduler may carry a step's replies and
        the next step's pushes (a colocated rank that finished its backward
        early): the others need those replies before they can push at all.
        """
        if transfer.slice_id == STOP:
            return (float("inf"), order)
        if self.fifo:
            return (order,)
        return (transfer.step, *transfer.priority, order)

    def drain(self) -> None:
        """Block until every submitted transfer has completed."""
        wait_until(self._drained, lambda: not (self._queue or self._issuing or any(self._in_flight.values()))
                   or self.error is not None)
        with self._cond:
            self._raise_if_failed()

    def close(self) -> None:
        """Drain, then stop the threads."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._stopping = True
                self._wake_all()
                threads = list(self._threads)
            for thread in threads:
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
                    self._wake_all()
        return run

    def _wake_all(self) -> None:
        """Wake every thread and waiter (stopping, or a thread failed); hold the lock."""
        for cond in (self._cond, self._drained, *self._route_ready.values()):
            cond.notify_all()

    def _next(self) -> int | None:
        """Position in the queue of the most urgent transfer whose peer has credit for it, else None.

        A slice may pass a larger one waiting for credit, but a stop mark never passes a slice of its own
        channel: the receiver reads no header after the stream's stops (it keeps exactly ``RING`` posted),
        so a slice sent after them would never be taken, its send and acknowledgement never complete
        (``drain`` waits for ever) and its receiver never gets it (bounded staleness: a straggler closes
        with its last pushes still queued, and the stops of those channels, 16 bytes each, fit the credit).
        """
        waiting: set[tuple[int, int]] = set()   # (peer, channel) of the slices passed over for want of credit
        for position, queued in enumerate(self._queue):
            transfer = queued.transfer
            if transfer.slice_id == STOP and (transfer.peer, transfer.channel) in waiting:
                continue
            in_flight = self._peer_bytes.get(transfer.route, 0)
            if self.credit_bytes is None or in_flight == 0 or in_flight + transfer.nbytes <= self.credit_bytes:
                return position
            waiting.add((transfer.peer, transfer.channel))
        return None

    def _issue_loop(self) -> None:
        while True:
            with self._cond:
                while (position := self._next()) is None:
                    if self._stopping or self.error is not None:
                        return
                    self._cond.wait(POLL_S)
                transfer = self._queue.pop(position).transfer
                self._peer_bytes[transfer.route] = self._peer_bytes.get(transfer.route, 0) + transfer.nbytes
                self._issuing += 1
            issued_at = time.time()
            try:
                works = self._issue(transfer)
            except RuntimeError as exc:
                raise TransferError(f"sending to rank {transfer.peer} failed: {exc}") from exc
            with self._cond:
                if self.issued is not None:
                    self.issued.append(transfer)
                route = transfer.route
                if route not in self._in_flight:   # one completion thread per route: a slow peer
                    self._in_flight[route] = deque()   # holds back no other peer's (or lane's) credit
                    self._route_ready[route] = threading.Condition(self._lock)
                    thread = threading.Thread(target=self._guard(lambda route=route: self._complete_loop(route)),
                                              name=f"{self._name}-done{route[0]}.{route[1]}", daemon=True)
                    self._threads.append(thread)
                    thread.start()
                self._in_flight[route].append((transfer, works, issued_at))
                self._issuing -= 1
                self._route_ready[route].notify()   # drain() cannot be done: the route has a send

    def _issue(self, transfer: Transfer) -> list:
        """Start ``transfer``'s sends (and the receive of its acknowledgement): the works to wait for."""
        works = []
        if self.acked and transfer.payload is not None:
            # Posted before the payload goes, so the receiver's acknowledgement never waits for it.
            works.append(dist.irecv(torch.empty(1, dtype=torch.int64), transfer.peer, group=transfer.ack_group,
                                    tag=ack_tag(transfer.lane)))
        # The payload first: its receive is posted already, so its bytes
        # flow at once; the header tells the receiver it is coming.
        if transfer.payload is not None:
            works.append(dist.isend(transfer.payload, transfer.peer, group=transfer.group,
                                    tag=payload_tag(transfer.slice_id)))
        works.append(dist.isend(header(transfer.slice_id, transfer.step), transfer.peer,
                                group=transfer.group, tag=HEADER_TAG))
        return works

    def _complete_loop(self, route: tuple[int, int]) -> None:
        """Wait for the sends of ``route`` (peer, lane) in issue order and return their credit."""
        in_flight, ready = self._in_flight[route], self._route_ready[route]
        while True:
            with self._cond:
                while not in_flight:
                    if self._stopping or self.error is not None:
                        return
                    ready.wait(POLL_S)
                transfer, works, issued_at = in_flight[0]
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:
                raise TransferError(f"sending to rank {transfer.peer} failed: {exc}") from exc
            done_at = time.time()
            with self._cond:
                in_flight.popleft()
                self._peer_bytes[route] -= transfer.nbytes
                self._cond.notify()
                self._drained.notify_all()
            if transfer.on_sent is not None:
                transfer.on_sent(transfer, issued_at, done_at)
