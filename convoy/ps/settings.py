"""The knobs of parameter-server training, resolved per priority mode."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from convoy.emulation.topology import parse_rate
from convoy.errors import UsageError
from convoy.ps.sharding import link_shares

PRIORITY_MODES = ("graph", "timed", "fifo")
DEFAULT_PRIORITY = "graph"   # the next forward's order, from the traced graph (P3, ByteScheduler)
COLOCATED = "colocated"   # --servers colocated: every rank serves a shard and trains
LINKS = "links:"          # --shard-weights links:RATE,...: shares fitted to the ranks' link rates

# Defaults of the prioritised modes: P3 slices at 40 k parameters and
# ByteScheduler keeps 4 MB in flight; 256 kB slices keep per-slice overhead low.
# The window is per peer and counts bytes until the receiver acknowledges them:
# two slices per peer keep a 100 Mbit link busy even with one peer to send to,
# and with three peers they queue at most 1.5 MB (120 ms at 100 Mbit) ahead
# of an urgent slice.
DEFAULT_SLICE_KB = 256.0
DEFAULT_CREDIT_KB = 512.0
DEFAULT_CHANNELS = 2


@dataclass(frozen=True)
class PSSettings:
    """How transfers between servers and workers are scheduled.

    Args:
        servers: S, the number of dedicated server ranks; with ``colocated`` every
            rank serves a shard (the job's size, known to the layout, counts).
        colocated: every rank serves a shard of the parameters and trains.
        staleness: steps a worker may run ahead of the slowest (0: synchronous).
        priority: ``graph`` (forward order from the traced graph), ``timed``
            (the timing-aware order), or ``fifo`` (arrival order; the baseline).
        channels: process groups per server-worker pair.
        slice_bytes: tensors larger than this are cut into slices; ``None`` sends whole tensors.
        credit_bytes: bytes a sender keeps in flight to each peer at most, until the receiver
            acknowledges them; ``None`` is unlimited (and unacknowledged).
        trace_steps: record a timeline of this many steps (after the first) for Chrome's tracer; 0: none.
        shard_weights: colocated servers: each rank's share of the parameters, in proportion (one
            value > 0 per rank); empty: equal shares.

    Example::

        >>> PSSettings.resolve(servers=1, priority="fifo").slice_bytes is None
        True
    """

    servers: int = 1
    priority: str = DEFAULT_PRIORITY
    channels: int = DEFAULT_CHANNELS
    slice_bytes: int | None = int(DEFAULT_SLICE_KB * 1024)
    credit_bytes: int | None = int(DEFAULT_CREDIT_KB * 1024)
    trace_steps: int = 0
    colocated: bool = False
    staleness: int = 0
    shard_weights: tuple[float, ...] = ()

    @property
    def acked(self) -> bool:
        """Receivers acknowledge every slice: a credit window counts bytes until they are delivered."""
        return self.credit_bytes is not None

    @classmethod
    def resolve(cls, servers: int | str = 1, priority: str = DEFAULT_PRIORITY, channels: int | None = None,
                slice_kb: float | None = None, credit_kb: float | None = None,
                trace_steps: int = 0, staleness: int = 0,
                shard_weights: str | Sequence[float] | None = None) -> "PSSettings":
        """Settings from user values; ``None`` takes the mode's default.

        FIFO defaults to the plain parameter server: one channel, whole tensors,
        no credit limit. The prioritised modes default to slices and a window.
        """
        colocated = servers == COLOCATED
        servers = 1 if colocated else parse_servers(servers)
        check(servers, priority, channels, slice_kb, credit_kb, staleness)
        if staleness and not colocated:
            raise UsageError("--staleness needs --servers colocated")
        weights = parse_shard_weights(shard_weights)
        if weights and not colocated:
            raise UsageError("--shard-weights needs --servers colocated")
        fifo = priority == "fifo"
        if channels is None:
            channels = 1 if fifo else DEFAULT_CHANNELS
        if slice_kb is None and not fifo:
            slice_kb = DEFAULT_SLICE_KB
        if credit_kb is None and not fifo:
            credit_kb = DEFAULT_CREDIT_KB
        return cls(servers, priority, channels, _bytes(slice_kb), _bytes(credit_kb), trace_steps, colocated,
                   staleness, weights)


def parse_shard_weights(value: str | Sequence[float] | None) -> tuple[float, ...]:
    """``--shard-weights``: comma-separated numbers > 0, one per rank (``None``: equal shares), or
    ``links:`` and each rank's link rate, for the shares :func:`convoy.ps.sharding.link_shares` fits to them.

    Example::

        >>> parse_shard_weights("1,1,1,0.25")
        (1.0, 1.0, 1.0, 0.25)
        >>> [round(w, 2) for w in parse_shard_weights("links:1gbit,1gbit,1gbit,250mbit")]
        [0.33, 0.33, 0.33, 0.01]
    """
    if value is None:
        return ()
    if isinstance(value, str) and value.startswith(LINKS):
        return tuple(link_shares([parse_rate(rate) for rate in value[len(LINKS):].split(",")]))
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        weights = tuple(float(item) for item in items)
    except (TypeError, ValueError):
        weights = ()
    if not weights or not all(0 < w < math.inf for w in weights):
        raise UsageError(f"--shard-weights must be numbers > 0, one per rank, e.g. 1,1,1,0.25 (or {LINKS} and "
                         f"each rank's link rate, e.g. {LINKS}1gbit,1gbit,250mbit); got {value!r}")
    return weights


def parse_servers(value: int | str) -> int | str:
    """``--servers``: ``colocated``, or a whole number of dedicated server ranks (as an int).

    Example::

        >>> parse_servers("2"), parse_servers("colocated")
        (2, 'colocated')
    """
    if value == COLOCATED:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if not text.lstrip("+-").isdigit():
        raise UsageError(f"unknown --servers {value!r}; choose {COLOCATED} (every rank serves a shard) "
                         "or a number of dedicated server ranks")
    return int(text)


def check(servers: int | None, priority: str, channels: int | None, slice_kb: float | None,
          credit_kb: float | None, staleness: int = 0) -> None:
    """Raise UsageError for a value no mode accepts."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise UsageError(f"--staleness must be a whole number >= 0 (0: synchronous), got {staleness!r}")
    if servers is not None and servers < 1:
        raise UsageError(f"--servers must be >= 1, got {servers}")
    if priority not in PRIORITY_MODES:
        raise UsageError(f"unknown --priority {priority!r}; choose one of: {', '.join(PRIORITY_MODES)}")
    if channels is not None and channels < 1:
        raise UsageError(f"--channels must be >= 1, got {channels}")
    for flag, value in (("--slice-kb", slice_kb), ("--credit-kb", credit_kb)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")


def _bytes(kb: float | None) -> int | None:
    return None if kb is None else max(int(kb * 1024), 4)
