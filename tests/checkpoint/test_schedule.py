"""The checkpoint schedule (convoy.checkpoint.schedule) against a plain enumeration of its rules.

No engine, files or threads: the schedule is bookkeeping, fed the steps and (for ``"auto"``)
a clock and counters, so its every decision is checked here exactly.
"""
from __future__ import annotations

import itertools

import pytest

from convoy.checkpoint.schedule import AUTO_PROBE_STEPS, Schedule

STEPS = 40


def _expected(every: int, last_step: int, full_every: int, replay: bool, writer: bool) -> list[tuple]:
    """(step, due, full, writes the rank state, logs the update) by the rules, written out."""
    rows, checkpoints, first_full = [], 0, None
    for step in range(STEPS):
        due = (step + 1) % every == 0 or step == last_step
        full = due and (full_every == 0 or checkpoints % full_every == 0)
        state = due and (not (replay and full_every) or full)
        # The writer logs every step after the first full snapshot except those that take a new one;
        # nothing where every checkpoint is full.
        logged = writer and full_every > 1 and first_full is not None and not full
        rows.append((step, due, full, state, logged))
        if due:
            checkpoints += 1
            if full and first_full is None:
                first_full = step
    return rows


@pytest.mark.parametrize("every, full_every, replay, writer",
                         list(itertools.product([1, 2, 3], [0, 1, 4], [False, True], [True, False])))
def test_the_schedule_follows_its_rules_step_by_step(every, full_every, replay, writer):
    last_step = STEPS - 3
    schedule = Schedule(every=every, last_step=last_step, full_every=full_every, writer=writer, replay=replay)
    seen = []
    for step in range(STEPS):
        logged, due = schedule.logs_update(step), schedule.due(step)
        full = state = False
        if due:
            state, full, decided = schedule.take(lambda: pytest.fail("only full_every='auto' measures"))
            assert decided is None
        seen.append((step, due, full, state, logged))
    assert seen == _expected(every, last_step, full_every, replay, writer)


def test_auto_every_measures_then_adopts_the_largest_interval_any_rank_chose():
    """Plain steps take 1 s, checkpointed ones 1.1 s: 0.1 s against a 3% budget is every 4 steps;
    another rank chose 7, so every rank checkpoints every 7 steps from the step after the decision."""
    start, budget = 5, 0.03
    agreed = []

    def agree(value: int) -> int:
        agreed.append(value)
        return max(value, 7)

    schedule = Schedule(every="auto", last_step=1000, full_every=0, writer=True, budget=budget, start=start,
                        agree_every=agree)
    stats = {"stall_s": 0.0, "persist_s": 0.0}
    off, on = AUTO_PROBE_STEPS
    now, decided_at, message = 0.0, None, None
    for step in range(start, start + off + on):
        probing = start + off <= step < start + off + on
        assert schedule.due(step) == probing
        now += 1.1 if probing else 1.0
        stats = {"stall_s": stats["stall_s"] + 0.01 * probing, "persist_s": stats["persist_s"] + 0.5 * probing}
        message = schedule.observe(step, now, stats)
        if message is not None:
            decided_at = step
    assert decided_at == start + off + on - 1 and agreed == [4] and schedule.every == 7
    assert message.startswith("every 7 steps, the longest interval any rank chose")
    after = range(decided_at + 1, decided_at + 30)
    assert [step for step in after if schedule.due(step)] == [decided_at + 7 * k for k in range(1, 5)]


@pytest.mark.parametrize("settings", [dict(every=0), dict(every="often"), dict(full_every=-1), dict(budget=1.0)])
def test_out_of_range_settings_are_refused(settings):
    with pytest.raises(ValueError):
        Schedule(**{"every": 1, "last_step": 9, "full_every": 0, "writer": True, **settings})


@pytest.mark.parametrize("update_cpu_s, logs_after", [(0.05, False), (0.0005, True)])
def test_auto_checkpoints_steps_apart_stop_logging_where_full_snapshots_alone_cost_less(update_cpu_s, logs_after):
    """Checkpointed steps take 1.1 s against 1 s (every 4 steps at 3%): a full snapshot costing 0.2 s
    of CPU alone is 0.05 s a step; logging each step's update costs more at 0.05 s (a dense update),
    less at 0.5 ms. Decided at the probe's last checkpoint, with the interval."""
    schedule = Schedule(every="auto", last_step=1000, full_every="auto", writer=True)
    off, on = AUTO_PROBE_STEPS
    now, stats, messages, logged = 0.0, {"stall_s": 0.0, "persist_s": 0.0}, [], 0
    for step in range(off + on):
        logged += schedule.logs_update(step)
        now += 1.1 if schedule.due(step) else 1.0
        messages.append(schedule.observe(step, now, stats))
        if schedule.due(step):
            measured = {"full_cpu_s": 0.2, "update_cpu_s": update_cpu_s * logged, "logged_steps": logged}
            messages.append(schedule.take(lambda: measured)[2])
    assert schedule.every == 4 and logged == on - 1
    assert (schedule.full_every == 1) == (not logs_after)
    assert any(m and m.startswith("every checkpoint a full snapshot, no log") for m in messages) == (not logs_after)
    later = range(off + on, off + on + 20)
    assert any(schedule.logs_update(step) for step in later) == logs_after
    for step in later:
        if schedule.due(step):
            full = schedule.take(lambda: pytest.fail("decided already"))[1]
            assert full or logs_after


@pytest.mark.parametrize("update_cpu_s, warned", [(0.1, True), (0.001, False)])
def test_a_checkpoint_every_step_over_the_budget_is_said_with_the_way_out(update_cpu_s, warned):
    """Steps of 1 s and a budget of 3%: logging each step's update at 0.1 s cannot fit, and the
    decision says so; at 1 ms it fits and nothing more is said."""
    schedule = Schedule(every=1, last_step=1000, full_every="auto", writer=True)
    logged, message = 0, None
    for step in range(12):
        logged += schedule.logs_update(step)
        schedule.observe(step, float(step), {})
        measured = {"full_cpu_s": 0.2, "update_cpu_s": update_cpu_s * logged, "logged_steps": logged}
        message = schedule.take(lambda: measured)[2] or message
    assert message is not None and message.startswith("a full snapshot every")
    assert ("a checkpoint every step costs 10% of a step here" in message) == warned, message
