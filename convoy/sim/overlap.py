"""convoy's engine, step after step, as a timeline: where communication hides behind compute.

The main thread runs forward (layer l waits for layer l's update from the
previous step) and then backward, which makes gradients ready in reverse
order. The auxiliary thread walks the exchanges in one fixed order: it waits
until an exchange's layers are ready, compresses, starts the exchange on its
channel (the wire serves one exchange at a time, in order), and applies the
updates of exchanges that have ended whenever it looks up; after starting
the last one it finishes the rest in order. ``barrier=True`` is torch DDP
instead: buckets are all-reduced as they fill, and one optimizer step on the
main thread after backward and every all-reduce, before the next forward.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

# Steps simulated; the last one's period is the steady state (the pipeline
# settles after one step, since every gate is at most one step back).
_STEPS = 4


@dataclass(frozen=True)
class Exchange:
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
    """

    layers: tuple[int, ...]
    wire_s: float
    codec_s: float = 0.0
    channel: int = 0
    reply_s: float = 0.0
    remote: bool = False


@dataclass(frozen=True)
class Timeline:
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
    """

    step_s: float
    compute_s: float
    aux_s: float
    wire_s: float
    forward_wait_s: float
    busy_wire_share: float = 1.0


def simulate(forward: Sequence[float], backward: Sequence[float], update: Sequence[float],
             exchanges: Sequence[Exchange], barrier: bool = False) -> Timeline:
    """The steady-state step of the engine (or of DDP with ``barrier=True``).

    Example::

        >>> simulate([1, 1], [2, 2], [0, 0], [Exchange((1,), 0.5), Exchange((0,), 0.5)]).step_s
        6.5
    """
    n = len(forward)
    if not (len(backward) == len(update) == n) or sorted(l for e in exchanges for l in e.layers) != list(range(n)):
        raise ValueError("every layer needs a forward, backward and update time and exactly one exchange")
    updated = [0.0] * n            # when each layer's previous update ended
    main = aux = 0.0
    channels: dict[tuple[int, int], float] = {}
    starts, waits = [], []
    computing: list[tuple[float, float]] = []      # the main thread's forward and backward, last two steps
    on_wire: list[list[tuple[float, float]]] = []  # each step's exchanges on their channels
    for step in range(_STEPS):
        if step == _STEPS - 2:   # the busy share is taken of this step's exchanges, which end by the next one's
            computing.clear()
        starts.append(main)
        t, waited = main, 0.0
        for l in range(n):
            waited += max(0.0, updated[l] - t)
            t = max(t, updated[l])
            computing.append((t, t + forward[l]))
            t += forward[l]
        waits.append(waited)
        ready = [0.0] * n
        computing.append((t, t + sum(backward)))
        for l in reversed(range(n)):
            t += backward[l]
            ready[l] = t
        spans: list[tuple[float, float]] = []
        if barrier:
            main, updated = _ddp_step(t, ready, update, exchanges, channels, spans)
        else:
            main = t
            aux, updated = _aux_step(aux, ready, update, exchanges, channels, spans)
        on_wire.append(spans)
    main_work = sum(forward) + sum(backward)
    return Timeline(step_s=starts[-1] - starts[-2], compute_s=main_work + (sum(update) if barrier else 0.0),
                    aux_s=sum(e.codec_s + (0.0 if barrier else sum(update[l] for l in e.layers))
                              for e in exchanges if not e.remote),
                    wire_s=sum(e.wire_s + e.reply_s for e in exchanges), forward_wait_s=waits[-1],
                    busy_wire_share=_busy_share(on_wire[-2], computing))


def _busy_share(spans: list[tuple[float, float]], computing: list[tuple[float, float]]) -> float:
    """How much of ``spans`` (a step's exchanges, whose next forward is simulated too) overlaps ``computing``."""
    total = sum(end - start for start, end in spans)
    if total <= 0:
        return 1.0
    busy = sum(max(0.0, min(end, c_end) - max(start, c_start)) for start, end in spans for c_start, c_end in computing)
    return min(1.0, busy / total)


def _start(exchange: Exchange, now: float, channels: dict[tuple[int, int], float],
           spans: list[tuple[float, float]]) -> float:
    """Put ``exchange`` on its channel at ``now`` or when the channel frees up; return its end."""
    end = now
    for direction, seconds in enumerate((exchange.wire_s, exchange.reply_s)):
        if seconds or not direction:
            key = (exchange.channel, direction)
            start = max(end, channels.get(key, 0.0))
            end = start + seconds
            channels[key] = end
            spans.append((start, end))
    return end


def _aux_step(aux: float, ready: list[float], update: Sequence[float], exchanges: Sequence[Exchange],
              channels: dict[tuple[int, int], float], spans: list[tuple[float, float]]
              ) -> tuple[float, list[float]]:
    updated = [0.0] * len(ready)
    in_flight: deque[tuple[Exchange, float]] = deque()

    def finish(exchange: Exchange, now: float) -> float:
        for l in exchange.layers:
            now += update[l]
            updated[l] = now
        return now

    for exchange in (e for e in exchanges if e.remote):
        finish(exchange, _start(exchange, max(ready[l] for l in exchange.layers) + exchange.codec_s, channels, []))
    now = aux
    for exchange in (e for e in exchanges if not e.remote):
        now = max([now] + [ready[l] for l in exchange.layers]) + exchange.codec_s
        in_flight.append((exchange, _start(exchange, now, channels, spans)))
        while in_flight and in_flight[0][1] <= now:   # is_done() polled after each start
            now = finish(in_flight.popleft()[0], now)
    while in_flight:
        exchange, end = in_flight.popleft()
        now = finish(exchange, max(now, end))
    return now, updated


def _ddp_step(backward_end: float, ready: list[float], update: Sequence[float], exchanges: Sequence[Exchange],
              channels: dict[tuple[int, int], float], spans: list[tuple[float, float]]
              ) -> tuple[float, list[float]]:
    end = backward_end
    for exchange in exchanges:
        # DDP launches a bucket's all-reduce from the autograd hook, on the main
        # thread: codec time (PowerSGD's matmuls) delays backward too, ignored here.
        end = max(end, _start(exchange, max(ready[l] for l in exchange.layers) + exchange.codec_s, channels,
                              spans))
    done = end + sum(update)
    return done, [done] * len(ready)
