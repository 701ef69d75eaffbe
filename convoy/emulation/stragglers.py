"""Slow hosts in an emulated cluster, from a cluster file: a slower link, or a share of the CPU.

A cluster file names the hosts that differ from the others::

    # bench/straggler.toml: host 3 computes at a quarter of the others' speed
    [hosts.3]
    cpu = 0.25        # the share of each 100 ms period its processes may run
    rate = "25mbit"   # its link (default: --rate)

A host's CPU share is enforced by a duty cycle (:mod:`convoy.emulation.dutycycle`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from convoy.emulation.topology import parse_rate
from convoy.errors import UsageError
from convoy.utils.toml import read_toml

_KEYS = ("cpu", "rate")


@dataclass(frozen=True)
class Stragglers:
    """Per host, its CPU share (1.0: the whole core it has) and its link rate in bits/s (None: the default).

    Example::

        >>> Stragglers(cpu={3: 0.25}).command(3, ["python", "train.py"])[:4]
        ['...python', '-m', 'convoy.emulation.dutycycle', '0.25']
    """

    cpu: dict[int, float] = field(default_factory=dict)
    rate: dict[int, float] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str, hosts: int) -> "Stragglers":
        """The slow hosts of cluster file ``path`` for a cluster of ``hosts`` hosts (UsageError on a bad entry)."""
        table = read_toml(path, "cluster file")
        unknown = set(table) - {"hosts"}
        if unknown:
            raise UsageError(f"cluster file {path}: unknown table {sorted(unknown)[0]!r}; use [hosts.N]")
        cpu, rate = {}, {}
        for name, entry in table.get("hosts", {}).items():
            if not (name.isdigit() and int(name) < hosts) or not isinstance(entry, dict):
                raise UsageError(f"cluster file {path}: [hosts.{name}] is not a host of 0..{hosts - 1}")
            host = int(name)
            for key in entry:
                if key not in _KEYS:
                    raise UsageError(f"cluster file {path}: [hosts.{name}] {key!r}; valid keys: {', '.join(_KEYS)}")
            if "cpu" in entry:
                share = entry["cpu"]
                if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
                    raise UsageError(f"cluster file {path}: [hosts.{name}] cpu must be in (0, 1], got {share!r}")
                cpu[host] = float(share)
            if "rate" in entry:
                rate[host] = parse_rate(str(entry["rate"]))
        return cls(cpu, rate)

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` as ``host`` runs it: under the duty cycle when its CPU share is below 1."""
        share = self.cpu.get(host, 1.0)
        if share >= 1.0:
            return argv
        return [sys.executable, "-m", "convoy.emulation.dutycycle", f"{share:g}", "--", *argv]

    def describe(self) -> str:
        parts = [f"host {h} at {s:g} of the CPU" for h, s in sorted(self.cpu.items())]
        parts += [f"host {h} on a {r / 1e6:g} Mbit link" for h, r in sorted(self.rate.items())]
        return ", ".join(parts)
