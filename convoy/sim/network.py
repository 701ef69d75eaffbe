"""Links and the time of collectives over them (the alpha-beta model).

A message of ``b`` bytes over a link takes ``latency + max(wake, b / rate)``:
``wake`` is the receiver's own per-message time (its thread being scheduled,
the stack's work), which the kernel's socket buffers let overlap the bytes
arriving, so it shows on small messages only. A ring
all-reduce moves ``2 (n-1)/n`` of the payload through every link in ``2 (n-1)``
steps, a ring all-gather ``n-1`` payloads in ``n-1`` steps; with a power-of-two
``n`` the recursive halving/doubling versions move the same bytes in only
``log2 n`` steps each way (Thakur, Rabenseifner and Gropp, 2005), which is what
keeps small messages cheap on a thousand nodes. ``allreduce`` and ``allgather``
take the faster of the two. Anything "via a server" puts ``n-1`` copies
through the server's link.
"""
from __future__ import annotations

from dataclasses import dataclass

from convoy.errors import UsageError

# TCP over Ethernet carries 1448 payload bytes (timestamps on) in a 1514-byte
# frame, and tc shapes frame bytes: payload goes at 95.6% of the shaped rate.
TCP_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True)
class Link:
    """A network path: payload bytes per second and seconds of latency per message.

    Args:
        bytes_per_s: payload rate, > 0.
        latency_s: one-way latency of one message, >= 0.
        wake_s: the receiver's per-message time, hidden behind any transfer longer
            than it (a thread woken on a busy machine: milliseconds), >= 0.

    Example::

        >>> Link.from_bits(100e6).transfer(1_000_000)   # 1 MB over 100 Mbit
        0.0836...
    """

    bytes_per_s: float
    latency_s: float = 0.0
    wake_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise UsageError(f"link bandwidth must be > 0, got {self.bytes_per_s} bytes/s")
        if self.latency_s < 0 or self.wake_s < 0:
            raise UsageError(f"link latency and wake-up must be >= 0, got {self.latency_s} and {self.wake_s} s")

    @classmethod
    def from_bits(cls, bits_per_s: float, latency_s: float = 0.0,
                  efficiency: float = TCP_EFFICIENCY, wake_s: float = 0.0) -> "Link":
        """A link shaped to ``bits_per_s`` on the wire, of which ``efficiency`` is payload."""
        if not bits_per_s > 0:
            raise UsageError(f"link rate must be > 0, got {bits_per_s} bit/s")
        return cls(bits_per_s / 8 * efficiency, latency_s, wake_s)

    def transfer(self, nbytes: float) -> float:
        """One message of ``nbytes`` from one end to the other."""
        return self.latency_s + max(self.wake_s, nbytes / self.bytes_per_s)


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter then all-gather around a ring of ``n``: ``2 (n-1)`` steps of ``nbytes / n``.

    Example::

        >>> ring_allreduce(10e6, 4, Link(12.5e6))   # 10 MB, 4 hosts, 100 Mbit of payload
        1.2
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.transfer(nbytes / n)


def ring_allgather(nbytes_each: float, n: int, link: Link) -> float:
    """Every rank's ``nbytes_each`` to every rank around a ring: ``n-1`` steps of one payload."""
    if n <= 1 or nbytes_each <= 0:
        return 0.0
    return (n - 1) * link.transfer(nbytes_each)


def allreduce(nbytes: float, n: int, link: Link) -> float:
    """The faster of the ring and recursive halving/doubling.

    Halving/doubling runs on the largest power of two ``p <= n``; the ``n - p``
    other ranks first hand their data to a partner and get the result back
    (two more full-size messages), as in Thakur, Rabenseifner and Gropp.

    Example::

        >>> allreduce(4, 1024, Link(1e9, 1e-5)) < ring_allreduce(4, 1024, Link(1e9, 1e-5)) / 100
        True
    """
    ring = ring_allreduce(nbytes, n, link)
    if n <= 1 or nbytes <= 0:
        return ring
    p = 1 << (n.bit_length() - 1)
    # Step i of the halving (and of the doubling back) moves nbytes / 2**i.
    halving = 2 * sum(link.transfer(nbytes / 2 ** i) for i in range(1, p.bit_length()))
    if p < n:
        halving += 2 * link.transfer(nbytes)
    return min(ring, halving)


def allgather(nbytes_each: float, n: int, link: Link) -> float:
    """The faster of the ring and, for a power-of-two ``n``, recursive doubling."""
    ring = ring_allgather(nbytes_each, n, link)
    if n <= 1 or n & (n - 1):
        return ring
    return min(ring, sum(link.transfer(nbytes_each * 2 ** i) for i in range(n.bit_length() - 1)))


def via_server(nbytes: float, n: int, link: Link) -> float:
    """A reduce to (or a broadcast from) one server of a group of ``n``: ``n-1`` copies on its link."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return link.transfer((n - 1) * nbytes)


def p2p(nbytes: float, link: Link) -> float:
    """One point-to-point message."""
    return link.transfer(nbytes) if nbytes > 0 else 0.0
