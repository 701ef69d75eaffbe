"""Slices on a channel: headers in order on one tag, payloads on a tag of their own.

Gloo sends a message's bytes only once the receiver has posted a matching
receive, so a receive posted late costs a round trip, and over a loaded link
(queues of 100 ms) one round trip per slice would cap a channel far below the
link's rate. Hence:

- Payload receives are posted ahead, before the peer can send: a worker posts
  its pulls of step t when backward t starts (the server cannot send them
  earlier); a server posts a worker's pushes of step t when the worker
  announces step t (at its first training forward of the step).
- Each slice's payload travels on its own tag, straight into its buffer.
- With acknowledgements (a sender whose credit counts bytes until they are
  delivered, :class:`~convoy.ps.scheduler.SliceScheduler` with ``acked``),
  the receiver answers every payload with a small message on ``ACK_TAG``, on
  the pair's acknowledgement connection (:meth:`~convoy.ps.channels.Channels.ack_group`),
  whose receive the sender posted when it issued the slice.
- Headers (slice id, step) say in which order the sender issued the slices;
  the receiver keeps ``RING`` header receives posted at all times, so headers
  never wait either. A stream ends with ``RING`` stop headers, which consume
  exactly the receives still posted: nothing is left pending at shutdown.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

HEADER_TAG = 0
REPORT_TAG = 1      # worker -> server 0: (loss, correct, samples) of a step
STEP_TAG = 2        # worker -> server: "step t starts" (or -1: no more steps)
ACK_TAG = 3         # receiver -> sender: "a payload of yours is in" (the sender's credit comes back)
PUSH_LANE, REPLY_LANE = 0, 1   # a sender's credit lanes (SliceScheduler): pushes, and a server's replies


def ack_tag(lane: int) -> int:
    """The tag that acknowledges a payload of ``lane``: a colocated pair's pushes and replies share one
    acknowledgement connection, and each lane's receives must match its own acknowledgements."""
    return ACK_TAG + lane
_PAYLOAD_TAG0 = 16
RING = 16           # header receives kept posted per channel
STOP = -1


def header(slice_id: int, step: int) -> torch.Tensor:
    return torch.tensor([slice_id, step], dtype=torch.int64)


HEADER_BYTES = 16
_ACK = torch.zeros(1, dtype=torch.int64)   # an acknowledgement's content is never read


def payload_tag(slice_id: int) -> int:
    return _PAYLOAD_TAG0 + slice_id


class PostedRecvs:
    """Payload receives posted ahead, keyed by (peer, slice id, step).

    Args:
        group_of: (peer, slice id) -> the channel's process group.
        buffer_of: (peer, slice id, step) -> the tensor the payload lands in (its size is what
            the peer sends that step).

    Example::

        >>> recvs = PostedRecvs(lambda peer, sid: group, lambda peer, sid, step: buffers[sid])
        >>> recvs.post(0, slice_id=3, step=7)            # ahead of the sender
        >>> recvs.take(0, slice_id=3, step=7).wait()     # once its header arrived
    """

    def __init__(self, group_of: Callable[[int, int], dist.ProcessGroup],
                 buffer_of: Callable[[int, int, int], torch.Tensor]):
        self._group_of, self._buffer_of = group_of, buffer_of
        self._works: dict[tuple[int, int, int], Any] = {}
        self._taken: dict[tuple[int, int], int] = {}   # (peer, slice) -> last step taken
        self._lock = threading.Lock()

    def post(self, peer: int, slice_id: int, step: int) -> None:
        """Post the receive of ``slice_id``'s payload of ``step`` from ``peer`` (once).

        A receive already taken is not posted again: the header may overtake
        the announcement that would have posted it.
        """
        with self._lock:
            key = (peer, slice_id, step)
            if key not in self._works and self._taken.get((peer, slice_id), -1) < step:
                self._works[key] = dist.irecv(self._buffer_of(peer, slice_id, step), peer,
                                              group=self._group_of(peer, slice_id), tag=payload_tag(slice_id))

    def take(self, peer: int, slice_id: int, step: int) -> Any:
        """The receive's work (posted now if it was not), forgotten by the registry."""
        self.post(peer, slice_id, step)
        with self._lock:
            self._taken[(peer, slice_id)] = step
            return self._works.pop((peer, slice_id, step))


class Receiver(threading.Thread):
    """Reads one channel's headers in order and waits for each slice's payload.

    Args:
        peer: global rank of the sender.
        group: the channel's process group.
        recvs: where the payload receives are posted.
        on_slice: called with (slice id, step, time the header arrived) once a payload is in.
        on_error: called with the exception if the stream breaks (a dead peer).
        ack: acknowledge every payload to the sender on this group (its credit counts bytes until
            delivered); ``None``: no acknowledgements.
        lane: the sender's credit lane these payloads travel in (``PUSH_LANE`` or ``REPLY_LANE``).
    """

    def __init__(self, peer: int, group: dist.ProcessGroup, recvs: PostedRecvs,
                 on_slice: Callable[[int, int, float], None], on_error: Callable[[BaseException], None],
                 name: str, ack: dist.ProcessGroup | None = None, lane: int = PUSH_LANE):
        super().__init__(name=name, daemon=True)
        self.peer, self.group, self._recvs, self._lane = peer, group, recvs, lane
        self._on_slice, self._on_error = on_slice, on_error
        self._ack_group = ack
        self._acks: deque = deque()

    def run(self) -> None:
        try:
            ring = [torch.empty(2, dtype=torch.int64) for _ in range(RING)]
            works = [self._post(head) for head in ring]
            pending, stopping, i = RING, False, 0
            while pending:
                works[i].wait()
                pending -= 1
                slice_id, step = int(ring[i][0]), int(ring[i][1])
                if slice_id == STOP:
                    stopping = True   # the rest of the posted headers are stops too
                elif not stopping:
                    works[i] = self._post(ring[i])
                    pending += 1
                    arrived = time.time()
                    self._recvs.take(self.peer, slice_id, step).wait()
                    self._acknowledge()
                    self._on_slice(slice_id, step, arrived)
                i = (i + 1) % RING
            self._settle_acks(0)
        except BaseException as exc:  # the owner re-raises it on its main thread
            self._on_error(exc)

    def _acknowledge(self) -> None:
        """Tell the sender a payload is in (the sender posted this receive when it issued the slice)."""
        if self._ack_group is None:
            return
        self._acks.append(dist.isend(_ACK, self.peer, group=self._ack_group, tag=ack_tag(self._lane)))
        self._settle_acks(RING)

    def _settle_acks(self, keep: int) -> None:
        """Wait for the oldest acknowledgements until at most ``keep`` are outstanding."""
        while self._acks and len(self._acks) > keep:
            self._acks.popleft().wait()

    def _post(self, head: torch.Tensor) -> Any:
        return dist.irecv(head, self.peer, group=self.group, tag=HEADER_TAG)


class StepListener(threading.Thread):
    """On a server: receives a worker's step announcements, one receive posted at a time."""

    def __init__(self, peer: int, group: dist.ProcessGroup, on_step: Callable[[int], None],
                 on_error: Callable[[BaseException], None], name: str):
        super().__init__(name=name, daemon=True)
        self.peer, self.group = peer, group
        self._on_step, self._on_error = on_step, on_error

    def run(self) -> None:
        message = torch.empty(1, dtype=torch.int64)
        try:
            while True:
                dist.recv(message, self.peer, group=self.group, tag=STEP_TAG)
                if int(message[0]) < 0:
                    return
                self._on_step(int(message[0]))
        except BaseException as exc:
            self._on_error(exc)
