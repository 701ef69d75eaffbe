"""When to checkpoint and what kind: the listener's schedule, plain bookkeeping.

A checkpoint is due every ``every``-th step (and after the last). With
gradient compression most checkpoints are differential: a full snapshot every
``full_every`` checkpoints, and between them each step's exchanged update,
appended to the snapshot's log (:mod:`convoy.checkpoint.difflog`). Where a
rank can rebuild its own state alone, the rank files may be written only with
the full snapshots (``replay``; ``RANK_FILES``).

``every="auto"`` measures a few steps without and with checkpoints, then
checkpoints as often as keeps the measured cost within ``budget`` of a step
(CheckFreq's policy); ``full_every="auto"`` measures the first full snapshot
and the steps after it (:func:`full_interval`). Every rank adopts the largest
interval any rank chose: the caller passes how the ranks agree (``agree``), so
nothing here touches a process group, a thread or a clock.

Example::

    >>> schedule = Schedule(every=2, last_step=4, full_every=0, writer=True)
    >>> [step for step in range(5) if schedule.due(step)]
    [1, 3, 4]
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

AUTO_PROBE_STEPS = (4, 3)    # auto: steps measured without, then with checkpoints
DEFAULT_BUDGET = 0.03        # auto: the share of step time checkpoints may cost (CheckFreq's 3.5%)
DEFAULT_FULL_EVERY = "auto"  # differential: a full snapshot every this many checkpoints, or from the budget
# differential, auto: the interval until the first full snapshot's cost is known, and the longest
# (a resume by replay trains up to this many steps again)
FULL_EVERY_BOUNDS = (10, 100)
# Where a resume could rebuild the ranks' own files by replaying the log (a local compressor's
# residuals), which checkpoints write them: "every" one, so that a resume on any number of workers
# goes on from the newest step (the survivors of a lost host need the lost ranks' residuals of that
# step, and the dead world's log cannot be replayed on a re-dealt state), or only the "full"
# snapshots (a rank's residuals written once per full snapshot instead of every step; a resume on
# the same world replays the steps since, one on another world goes back to the snapshot).
RANK_FILES = ("every", "full")
DEFAULT_RANK_FILES = "every"

Agree = Callable[[int], int]   # the largest value any rank chose, given this rank's


def _alone(value: int) -> int:
    return value


class Schedule:
    """Which steps are checkpointed, which checkpoints are full, which write the rank files.

    Args:
        every: checkpoint after steps ``every - 1, 2 * every - 1, ...`` (counting from 0),
            or ``"auto"``: the most frequent interval whose measured cost stays within ``budget``.
        last_step: also checkpoint after this step (the end of training).
        full_every: differential checkpoints with a full snapshot every this many
            checkpoints (0: every checkpoint is full), or ``"auto"`` (:func:`full_interval`).
        writer: this rank writes a model file (only a writer logs updates).
        budget: ``every="auto"``, ``full_every="auto"``: the share of a step's time
            checkpoints may cost.
        replay: write the rank files only with the full snapshots.
        start: the first step this run trains (``"auto"`` measures from it).
        agree_every, agree_full: how the ranks agree on an ``"auto"`` interval (alone: as chosen).

    Raises:
        ValueError: ``every``, ``full_every`` or ``budget`` out of range.
    """

    def __init__(self, *, every: int | str, last_step: int, full_every: int | str, writer: bool,
                 budget: float = DEFAULT_BUDGET, replay: bool = False, start: int = 0,
                 agree_every: Agree = _alone, agree_full: Agree = _alone):
        if every != "auto" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an integer >= 1 or 'auto', got {every!r}")
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if full_every != "auto" and (not isinstance(full_every, int) or full_every < 0):
            raise ValueError(f"full_every must be an integer >= 0 or 'auto', got {full_every!r}")
        self.last_step, self.writer = last_step, writer
        self.auto = AutoFrequency(start, budget, agree_every) if every == "auto" else None
        self.every = 1 if every == "auto" else every
        self.every_from = 0                                 # the step the current interval counts from
        self.auto_full = AutoFullInterval(budget, agree_full) if full_every == "auto" else None
        self.full_every = FULL_EVERY_BOUNDS[0] if full_every == "auto" else full_every
        self.replay = replay and self.full_every > 0
        self.full_due, self.since_full = True, 0            # the next checkpoint's kind
        self.fulls = 0                                      # full snapshots taken in this run
        self.based = False                                  # a full snapshot was taken in this run

    def end_at(self, step: int) -> None:
        """Make ``step`` the last step: it is checkpointed (the job stops after it)."""
        self.last_step = step

    def due(self, step: int) -> bool:
        """Whether ``step`` is checkpointed."""
        if step == self.last_step:
            return True
        if self.auto is not None and not self.auto.decided:
            return self.auto.probing_with_checkpoints(step)
        return (step + 1 - self.every_from) % self.every == 0

    def writes_rank_state(self) -> bool:
        """Whether this rank's file is written at its next checkpoint: at every one, or (replay)
        only with the full snapshots."""
        return not self.replay or self.full_due

    def logs_update(self, step: int) -> bool:
        """Whether the writer appends ``step``'s update to the log: every step after a full
        snapshot (a later checkpoint replays them all), except the steps that take a new one;
        none where every checkpoint is full (no checkpoint replays them)."""
        return bool(self.writer and self.full_every > 1 and self.based and not (self.full_due and self.due(step)))

    def observe(self, step: int, now: float, stats: dict[str, float]) -> str | None:
        """``step`` ended at ``now`` with the listener's counters ``stats``; returns what was
        decided, if an ``"auto"`` interval was (then it holds from the next step)."""
        decided = None
        if self.auto is not None and not self.auto.decided:
            self.auto.observe(step, now, stats)
            if self.auto.decided_at(step):
                every = self.auto.decide(stats)
                self.every, self.every_from = every, step + 1
                decided = (f"every {every} step{'s' if every > 1 else ''}, the longest interval "
                           f"any rank chose ({self.auto.describe()})")
        if self.auto_full is not None and self.fulls and not self.auto_full.decided:
            self.auto_full.observe(now)
        return decided

    def take(self, measured: Callable[[], dict[str, float]]) -> tuple[bool, bool, str | None]:
        """A due step's checkpoint: whether it writes the rank state, whether it is full, and
        what was decided (``full_every="auto"`` decides with ``measured()``, the counters once
        the persister has caught up)."""
        with_state, full, decided = self.writes_rank_state(), self.full_due, None
        if self.full_every:   # every rank follows the schedule: replay writes rank files with the full ones
            self.fulls += full
            self.since_full = 0 if full else self.since_full + 1
            # Checkpoints more than a step apart log every step between them: how that compares
            # with full snapshots alone is known once one of each was measured.
            if self.auto_full is not None and not self.auto_full.decided \
                    and (self.since_full + 1 >= self.full_every or (self.every > 1 and self.since_full > 0)):
                self.full_every = self.auto_full.decide(dict(measured(), fulls=self.fulls), self.every)
                kind = ("every checkpoint a full snapshot, no log (logging each step's update would cost more)"
                        if self.full_every == 1 else f"a full snapshot every {self.full_every} checkpoints")
                decided = f"{kind}, the longest interval any rank chose ({self.auto_full.describe()})"
            self.full_due = self.since_full + 1 >= self.full_every
            self.based = True
        return with_state, full, decided


class AutoFrequency:
    """CheckFreq's policy: measure, then the shortest interval whose cost fits the budget.

    Steps ``start .. start+W-1`` run without checkpoints, the next P with a
    checkpoint each; the first of each phase is not timed (warm-up). A
    checkpoint's cost is the slower step (the persister's interference
    included), at least the stall on the training path; the interval is also
    at least the persist time over the step time, so the writes keep up.
    """

    def __init__(self, start: int, budget: float, agree: Agree = _alone):
        self.start, self.budget, self.agree = start, budget, agree
        self.decided = False
        self._ends: list[tuple[int, float]] = []
        self._stats0: dict[str, float] = {}
        self.summary: dict[str, float] = {}

    def probing_with_checkpoints(self, step: int) -> bool:
        off, on = AUTO_PROBE_STEPS
        return self.start + off <= step < self.start + off + on

    def decided_at(self, step: int) -> bool:
        return step == self.start + sum(AUTO_PROBE_STEPS) - 1

    def observe(self, step: int, now: float, stats: dict) -> None:
        self._ends.append((step, now))
        if step == self.start + AUTO_PROBE_STEPS[0] - 1:
            self._stats0 = dict(stats)

    def decide(self, stats: dict) -> int:
        off, on = AUTO_PROBE_STEPS
        gaps = {s: t - t0 for (s0, t0), (s, t) in zip(self._ends, self._ends[1:])}
        plain = statistics.median(gaps[s] for s in range(self.start + 1, self.start + off) if s in gaps)
        checked = statistics.median(gaps[s] for s in range(self.start + off + 1, self.start + off + on)
                                    if s in gaps)
        stall = (stats["stall_s"] - self._stats0.get("stall_s", 0.0)) / on
        persist = (stats["persist_s"] - self._stats0.get("persist_s", 0.0)) / on
        cost = max(checked - plain, stall)
        every = self.agree(max(1, math.ceil(cost / (self.budget * plain)), math.ceil(persist / plain)))
        self.summary = {"step_s": plain, "cost_s": cost, "stall_s": stall, "persist_s": persist, "every": every}
        self.decided = True
        return every

    def describe(self) -> str:
        s = self.summary
        return (f"rank 0 measured: step {1000 * s['step_s']:.0f} ms, a checkpoint costs {1000 * s['cost_s']:.0f} ms "
                f"on the training path, persists in {1000 * s['persist_s']:.0f} ms; budget {100 * self.budget:g}%")


def full_interval(full_cost_s: float, update_cost_s: float, step_s: float, every: int, budget: float) -> int:
    """Checkpoints between full snapshots: the fewest whose cost per step fits ``budget``, or 1
    (every checkpoint full, no log) where that costs no more.

    A full snapshot costs ``full_cost_s`` and every step's logged update
    ``update_cost_s`` (CPU seconds of the listener's threads, a conservative
    measure where spare cores would absorb them); with a checkpoint every
    ``every`` steps of ``step_s``, ``K`` checkpoints apart the cost per step is
    ``update_cost_s + full_cost_s / (K * every)``. Bounded by
    ``FULL_EVERY_BOUNDS``: at least the interval used while measuring, at most
    the replay a resume may have to train again. Full snapshots alone cost
    ``full_cost_s / every`` a step: less where a step's update is dense (the
    log then holds a whole gradient a step) and checkpoints are steps apart.

    Example::

        >>> full_interval(0.16, 0.006, 0.6, 1, 0.02)   # room: 12 - 6 ms a step
        27
        >>> full_interval(0.16, 0.006, 0.6, 50, 0.02)  # full alone: 3.2 ms a step
        1
    """
    low, high = FULL_EVERY_BOUNDS
    room = budget * step_s - update_cost_s
    chosen = high if room <= 0 else min(high, max(low, math.ceil(full_cost_s / (room * every))))
    logged = update_cost_s + full_cost_s / (chosen * every)
    return 1 if full_cost_s / every <= logged else chosen


class AutoFullInterval:
    """``full_every="auto"``: from the first full snapshot's cost and the steps after it, the
    interval of :func:`full_interval`; every rank adopts the largest any rank chose."""

    def __init__(self, budget: float, agree: Agree = _alone):
        self.budget, self.agree = budget, agree
        self.decided = False
        self._ends: list[float] = []
        self.summary: dict[str, float] = {}

    def observe(self, now: float) -> None:
        """A step ended at ``now`` (after the first full snapshot)."""
        self._ends.append(now)

    def decide(self, stats: dict, every: int) -> int:
        gaps = [b - a for a, b in zip(self._ends, self._ends[1:])]
        step_s = statistics.median(gaps) if gaps else 0.0
        full = stats["full_cpu_s"] / max(stats["fulls"], 1)
        update = stats["update_cpu_s"] / max(stats["logged_steps"], 1)
        if not stats["logged_steps"]:
            mine = 1   # logs nothing (not a writer): the writers' choice, the largest, is every rank's
        else:
            mine = full_interval(full, update, step_s, every, self.budget) if step_s > 0 else FULL_EVERY_BOUNDS[1]
        chosen = self.agree(mine)
        self.summary = {"step_s": step_s, "full_s": full, "update_s": update, "every": every, "chosen": chosen}
        self.decided = True
        return chosen

    def describe(self) -> str:
        s = self.summary
        said = (f"rank 0 measured: step {1000 * s['step_s']:.0f} ms, a full snapshot {1000 * s['full_s']:.0f} ms "
                f"and a step's update {1000 * s['update_s']:.1f} ms of CPU; budget {100 * self.budget:g}%")
        if s["every"] == 1 and s["chosen"] > 1 and s["update_s"] > self.budget * s["step_s"] > 0:
            # A checkpoint every step cannot fit the budget whatever the interval between full snapshots.
            said += (f"; a checkpoint every step costs {s['update_s'] / s['step_s']:.0%} of a step here: "
                     "checkpoints some steps apart (an interval, or auto) fit the budget")
        return said
