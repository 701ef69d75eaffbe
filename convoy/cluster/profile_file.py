"""``--node-profile FILE``: a TOML file that gives (some of) the nodes' indicators.

Layout: an optional ``[all]`` table for every rank, ``[hosts.NAME]`` tables for
the ranks on host NAME (its ``socket.gethostname()``), ``[ranks.N]`` tables for
rank N; later ones override earlier ones (all < host < rank). After merging,
every rank must be covered and have all six indicators; an indicator set to
the string ``"measure"`` is measured as usual. Example (two fast, two slow)::

    [all]
    cpu_mhz = 3000
    memory_gb = 16
    gpu_mhz = 0
    gpu_memory_gb = 0
    disk_mbps = "measure"
    uplink_mbps = 1000
    [ranks.2]
    uplink_mbps = 50
    [ranks.3]
    uplink_mbps = 50
"""
from __future__ import annotations

from dataclasses import dataclass, field

from convoy.cluster.indicators import INDICATORS
from convoy.errors import UsageError
from convoy.utils.toml import read_toml


MEASURE = "measure"


@dataclass
class ProfileOverrides:
    """The parsed file: tables for all ranks, per host and per rank.

    Example::

        >>> overrides = load_profile_file("nodes.toml")
        >>> overrides.for_rank(2, "node-b")["uplink_mbps"]
        50.0
    """

    path: str
    all: dict[str, float | str] = field(default_factory=dict)
    hosts: dict[str, dict[str, float | str]] = field(default_factory=dict)
    ranks: dict[int, dict[str, float | str]] = field(default_factory=dict)

    def for_rank(self, rank: int, host: str) -> dict[str, float]:
        """The values the file gives ``rank`` on ``host`` ("measure" left out); UsageError if incomplete."""
        if not self.all and host not in self.hosts and rank not in self.ranks:
            raise UsageError(f"--node-profile {self.path} has no table for rank {rank} (host {host!r}); "
                             f"add [ranks.{rank}], [hosts.\"{host}\"] or [all]")
        merged = {**self.all, **self.hosts.get(host, {}), **self.ranks.get(rank, {})}
        missing = [name for name in INDICATORS if name not in merged]
        if missing:
            raise UsageError(f"--node-profile {self.path}: rank {rank} lacks {', '.join(missing)} "
                             f"(give a number, or \"{MEASURE}\" to measure it)")
        return {name: float(value) for name, value in merged.items() if value != MEASURE}

    def check_world(self, world_size: int) -> None:
        """Checks that need only the world size: no rank outside it; every rank covered when no host tables."""
        outside = [rank for rank in self.ranks if rank >= world_size]
        if outside:
            raise UsageError(f"--node-profile {self.path} names rank {outside[0]}, but the job has "
                             f"{world_size} ranks (0..{world_size - 1})")
        if not self.hosts:   # hosts are known only once the workers run
            for rank in range(world_size):
                self.for_rank(rank, "")


def load_profile_file(path: str) -> ProfileOverrides:
    """Parse and check ``path``; UsageError names the first problem."""
    raw = read_toml(path, "--node-profile")
    every: dict[str, float | str] = {}
    hosts: dict[str, dict[str, float | str]] = {}
    ranks: dict[int, dict[str, float | str]] = {}
    for key, value in raw.items():
        if key == "all":
            every = _table(path, "[all]", value)
        elif key in ("hosts", "ranks") and isinstance(value, dict):
            for name, table in value.items():
                checked = _table(path, f"[{key}.{name}]", table)
                if key == "hosts":
                    hosts[name] = checked
                elif name.isdigit():
                    ranks[int(name)] = checked
                else:
                    raise UsageError(f"--node-profile {path}: [ranks.{name}] is not a rank number")
        else:
            raise UsageError(f"--node-profile {path}: unknown table or key {key!r}; "
                             "use [all], [hosts.NAME] or [ranks.N]")
    if not (every or hosts or ranks):
        raise UsageError(f"--node-profile {path} gives no node")
    return ProfileOverrides(path, every, hosts, ranks)


def _table(path: str, where: str, table: object) -> dict[str, float | str]:
    if not isinstance(table, dict):
        raise UsageError(f"--node-profile {path}: {where} must be a table of indicators")
    out: dict[str, float | str] = {}
    for name, value in table.items():
        if name not in INDICATORS:
            raise UsageError(f"--node-profile {path}: unknown indicator {name!r} in {where}; "
                             f"choose from: {', '.join(INDICATORS)}")
        if value == MEASURE:
            out[name] = MEASURE
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[name] = float(value)
        else:
            raise UsageError(f"--node-profile {path}: {where} {name} must be a number >= 0 or "
                             f"\"{MEASURE}\", got {value!r}")
    return out
