"""A pytest plugin that ranks tests by the CPU time they cost: ``python -m pytest -p tests.cputime``.

Per test (setup, call and teardown, module fixtures included where they run), the user + system
time of the pytest process, of the children it reaped, and of every process still alive below it
(the fork server and the ranks it forked, which their parent reaps: counted through /proc, their
own time plus their reaped children's). The summary lists the total and the 25 costliest tests;
``CPUTIME_OUT=path`` also writes every test's [cpu_s, wall_s, nodeid] there, one JSON line per
test as it ends (a run stopped early keeps what it measured).
Wall time depends on what else the machine runs; CPU time much less.
"""
from __future__ import annotations

import json
import os
import resource
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_rows: list[tuple[float, float, str]] = []


def _descendants_cpu(root: int) -> float:
    """CPU seconds of the live processes below ``root``: their own and their reaped children's."""
    parent, ticks = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:   # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()   # from the state on: ppid is 1, utime..cstime 11..14
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = sum(int(x) for x in fields[11:15])
    total = 0
    for pid in ticks:
        ancestor = parent.get(pid)
        while ancestor not in (None, 0, 1, root):
            ancestor = parent.get(ancestor)
        if ancestor == root:
            total += ticks[pid]
    return total / _TICK


def _cpu() -> float:
    me, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime + _descendants_cpu(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    yield
    _rows.append((_cpu() - cpu, time.monotonic() - wall, item.nodeid))
    if os.environ.get("CPUTIME_OUT"):
        with open(os.environ["CPUTIME_OUT"], "a") as f:
            f.write(json.dumps(_rows[-1]) + "\n")


def pytest_terminal_summary(terminalreporter):
    rows = sorted(_rows, reverse=True)
    terminalreporter.write_sep("-", f"CPU time: {sum(r[0] for r in rows):.1f} s over {len(rows)} tests")
    for cpu, wall, nodeid in rows[:25]:
        terminalreporter.write_line(f"{cpu:7.1f} s CPU {wall:7.1f} s wall  {nodeid}")
