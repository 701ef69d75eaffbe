"""convoy's engine, step after step, as a timeline: where communication hides behind compute.

The main thread runs forward (layer l waits for layer l's update from the
previous step) and then backward, which makes gradients ready in reverse
order. The auxiliary thread walks the exchanges in one fixed order: it waits
until an exchange's layers are ready, compresses, starts the exchange on its
channel, and applies the updates of exchanges that have ended whenever it
looks up; after starting the last one it finishes the rest in order. A
channel runs ``lanes`` exchanges at once (gloo's process group has two worker
threads): their bytes still queue on the link, but one's latency and
wake-ups hide behind the other's bytes. Where a rank has less than two cores
the two threads share them (``shared_rate``), so compression beside backward
slows both. ``barrier=True`` is torch DDP instead: buckets are all-reduced as
they fill, and one optimizer step on the main thread after backward and
every all-reduce, before the next forward.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Generator, Sequence

from convoy.sim import threads

# Steps simulated; the last one's period is the steady state (the pipeline
# settles after one step, since every gate is at most one step back).
_STEPS = 4


@dataclass(frozen=True)
class Transfer:
    """One exchange in the engine's fixed order.

    Args:
        layers: indices (forward order) of the layers it carries, updated when it ends.
        wire_s: seconds it occupies its channel.
        codec_s: seconds of compression on the auxiliary thread before it starts.
        channel: exchanges on different channels (separate links) do not wait for each other.
        reply_s: seconds of a second stage on the channel's other direction once
            the first ends (a server's reply: reduce in, then broadcast out).
        remote: run by other ranks (hybrid's FC ring, on the FC workers): it
            starts once its layers are ready, and this rank's auxiliary thread
            neither starts it nor waits for it before its own updates.
        bytes_s: the part of ``wire_s`` the link spends on its bytes (the rest is
            latency and wake-ups); None: all of it.
        agree: an exchange the auxiliary thread starts after compressing and waits
            for before it can start this one (global blocktopk's block scores).
    """

    layers: tuple[int, ...]
    wire_s: float
    codec_s: float = 0.0
    channel: int = 0
    reply_s: float = 0.0
    remote: bool = False
    bytes_s: float | None = None
    agree: Transfer | None = None


class _Channel:
    """One direction of a channel: its lanes and the link under them."""

    def __init__(self, lanes: int):
        self.lanes = [0.0] * lanes   # when each lane frees up
        self.bytes_free = 0.0        # when the link has sent the bytes queued on it

    def take(self, now: float, wire_s: float, bytes_s: float) -> tuple[float, float]:
        """Run ``wire_s`` on the first free lane from ``now``; return its (start, end)."""
        lane = min(range(len(self.lanes)), key=self.lanes.__getitem__)
        start = max(now, self.lanes[lane])
        self.bytes_free = max(start, self.bytes_free) + bytes_s
        self.lanes[lane] = max(start + wire_s, self.bytes_free)
        return start, self.lanes[lane]


@dataclass(frozen=True)
class StepTrace:
    """One steady-state step.

    Attributes:
        step_s: period between consecutive steps.
        compute_s: the main thread's work (forward, backward, and with a barrier
            the update): the step with free communication.
        aux_s: the auxiliary thread's work (updates and compression).
        wire_s: seconds the exchanges occupy their channels (hidden or not).
        forward_wait_s: how long the next forward waited for updates.
        busy_wire_share: the share of the exchanges' channel time during which the
            main thread computed (the network stack's CPU competes with it only then).
        aux_shared: the auxiliary thread's CPU already slowed the main thread here
            (``simulate(shared_rate=...)``); else it is the caller's to account for.
    """

    step_s: float
    compute_s: float
    aux_s: float
    wire_s: float
    forward_wait_s: float
    busy_wire_share: float = 1.0
    aux_shared: bool = False


def simulate(forward: Sequence[float], backward: Sequence[float], update: Sequence[float],
             exchanges: Sequence[Transfer], barrier: bool = False, lanes: int = 1,
             shared_rate: float | None = None) -> StepTrace:
    """The steady-state step of the engine (or of DDP with ``barrier=True``).

    Args:
        lanes: exchanges that run at once on each channel.
        shared_rate: the engine's main and auxiliary threads share the rank's CPU:
            while both compute, each runs at this share of its speed (0.5 for ranks
            with one core or less; :mod:`convoy.sim.threads`). None: each has a core,
            and the caller accounts for the auxiliary thread's CPU (``StepTrace.aux_shared``).

    Example::

        >>> simulate([1, 1], [2, 2], [0, 0], [Transfer((1,), 0.5), Transfer((0,), 0.5)]).step_s
        6.5
    """
    n = len(forward)
    if not (len(backward) == len(update) == n) or sorted(l for e in exchanges for l in e.layers) != list(range(n)):
        raise ValueError("every layer needs a forward, backward and update time and exactly one exchange")
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    run = _Run(forward, backward, update, exchanges, lanes)
    if barrier:
        run.ddp()
    else:
        threads.run([run.main_thread(), run.aux_thread()], shared_rate or 1.0)
    return StepTrace(step_s=run.starts[-1] - run.starts[-2],
                    compute_s=sum(forward) + sum(backward) + (sum(update) if barrier else 0.0),
                    aux_s=sum(e.codec_s + (0.0 if barrier else sum(update[l] for l in e.layers))
                              for e in exchanges if not e.remote),
                    wire_s=sum(e.wire_s + e.reply_s + (e.agree.wire_s if e.agree else 0.0) for e in exchanges),
                    forward_wait_s=run.waits[-1],
                    busy_wire_share=_busy_share(run.on_wire[-2], run.computing),
                    aux_shared=shared_rate is not None and not barrier)


class _Run:
    """``_STEPS`` steps of one rank: what each thread did when."""

    def __init__(self, forward: Sequence[float], backward: Sequence[float], update: Sequence[float],
                 exchanges: Sequence[Transfer], lanes: int):
        self.forward, self.backward, self.update = forward, backward, update
        self.own = [e for e in exchanges if not e.remote]
        self.remote = [e for e in exchanges if e.remote]
        n = len(forward)
        # updated[s][l]: when step s's update of layer l ended (step -1: at time 0); ready likewise.
        self.updated: list[list[float | None]] = [[0.0] * n] + [[None] * n for _ in range(_STEPS)]
        self.ready: list[list[float | None]] = [[None] * n for _ in range(_STEPS)]
        self.channels: dict[tuple[int, int], _Channel] = defaultdict(lambda: _Channel(lanes))
        self.starts: list[float] = []
        self.waits: list[float] = []
        self.computing: list[tuple[float, float]] = []      # forward and backward of the last two steps
        self.on_wire: list[list[tuple[float, float]]] = [[] for _ in range(_STEPS)]

    def main_thread(self) -> threads.Thread:
        """Forward (each layer after its previous update) and backward, step after step."""
        t = 0.0
        for step in range(_STEPS):
            if step == _STEPS - 2:   # the busy share is taken of this step's exchanges, which end by the next one's
                self.computing.clear()
            self.starts.append(t)
            waited = 0.0
            for l, seconds in enumerate(self.forward):
                begun = yield ("until", lambda step=step, l=l: self.updated[step][l])
                waited, t = waited + begun - t, begun
                t = yield ("cpu", seconds)
                self.computing.append((begun, t))
            self.waits.append(waited)
            begun = t
            for l in reversed(range(len(self.backward))):
                t = yield ("cpu", self.backward[l])
                self.ready[step][l] = t
                self._start_remote(step, l, t)
            self.computing.append((begun, t))

    def _start_remote(self, step: int, layer: int, now: float) -> None:
        for exchange in self.remote:
            if min(exchange.layers) == layer:   # the last of its layers backward reaches
                end = _start(exchange, now + exchange.codec_s, self.channels, [])
                for l in exchange.layers:
                    end += self.update[l]
                    self.updated[step + 1][l] = end

    def aux_thread(self) -> threads.Thread:
        """The engine's auxiliary thread: exchanges in their fixed order, updates as they end."""
        for step in range(_STEPS):
            in_flight: deque[tuple[Transfer, float]] = deque()
            for exchange in self.own:
                yield ("until", lambda step=step, e=exchange: _latest(self.ready[step], e.layers))
                now = yield ("cpu", exchange.codec_s)
                if exchange.agree is not None:
                    agreed = _start(exchange.agree, now, self.channels, self.on_wire[step])
                    now = yield ("until", lambda agreed=agreed: agreed)
                in_flight.append((exchange, _start(exchange, now, self.channels, self.on_wire[step])))
                while in_flight and in_flight[0][1] <= now:   # is_done() polled after each start
                    now = yield from self._finish(step, in_flight.popleft()[0])
            while in_flight:
                exchange, end = in_flight.popleft()
                yield ("until", lambda end=end: end)
                yield from self._finish(step, exchange)

    def _finish(self, step: int, exchange: Transfer) -> Generator[threads.Request, float, float]:
        now = 0.0
        for l in exchange.layers:
            now = yield ("cpu", self.update[l])
            self.updated[step + 1][l] = now
        return now

    def ddp(self) -> None:
        """torch DDP: buckets all-reduced as backward fills them, then one update before the next forward."""
        t, n = 0.0, len(self.forward)
        for step in range(_STEPS):
            if step == _STEPS - 2:
                self.computing.clear()
            self.starts.append(t)
            self.waits.append(0.0)
            self.computing.append((t, t + sum(self.forward) + sum(self.backward)))
            t += sum(self.forward)
            ready = [0.0] * n
            for l in reversed(range(n)):
                t += self.backward[l]
                ready[l] = t
            for exchange in self.own + self.remote:
                # DDP launches a bucket's all-reduce from the autograd hook, on the main
                # thread: codec time (PowerSGD's matmuls) delays backward too, ignored here.
                t = max(t, _start(exchange, max(ready[l] for l in exchange.layers) + exchange.codec_s,
                                  self.channels, self.on_wire[step]))
            t += sum(self.update)


def _latest(times: list[float | None], layers: tuple[int, ...]) -> float | None:
    """When the last of ``layers`` got there, or None while one has not."""
    got = [times[l] for l in layers]
    return None if any(x is None for x in got) else max(got)


def _busy_share(spans: list[tuple[float, float]], computing: list[tuple[float, float]]) -> float:
    """How much of ``spans`` (a step's exchanges, whose next forward is simulated too) overlaps ``computing``."""
    total = sum(end - start for start, end in spans)
    if total <= 0:
        return 1.0
    busy = sum(max(0.0, min(end, c_end) - max(start, c_start)) for start, end in spans for c_start, c_end in computing)
    return min(1.0, busy / total)


def _start(exchange: Transfer, now: float, channels: dict[tuple[int, int], _Channel],
           spans: list[tuple[float, float]]) -> float:
    """Put ``exchange`` on its channel at ``now`` or when a lane frees up; return its end."""
    end = now
    bytes_s = exchange.wire_s if exchange.bytes_s is None else exchange.bytes_s
    for direction, (seconds, on_link) in enumerate(((exchange.wire_s, bytes_s), (exchange.reply_s, exchange.reply_s))):
        if seconds or not direction:
            start, end = channels[(exchange.channel, direction)].take(end, seconds, on_link)
            spans.append((start, end))
    return end
