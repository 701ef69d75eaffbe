"""A cluster as the simulator sees it: nodes, racks, link rates, latency, compute speed.

Read from a TOML or JSON file, either in the simulator's own keys::

    nodes = 8                  # worker machines (ranks)
    rate = "1gbit"             # each host's link
    rates = ["1gbit", "1gbit", "250mbit", ...]   # or: one link rate per node
    racks = 2                  # optional
    inter_rack_rate = "100mbit"
    latency_ms = 0.05
    wake_ms = 1                # optional: a receiver's per-message wake-up (busy shared hosts)
    lanes = 2                  # optional: collectives a process group runs at once (gloo 2, NCCL 1)
    speeds = [1, 1, 1, 1, 0.5, 0.5, 1, 1]   # optional, relative to the profiling machine
    cores = 0.5                # optional: CPU cores per rank, when ranks share a machine's cores

or as written by ``convoy profile-nodes --json`` (``{"nodes": [{"rank", "host",
"cpu_mhz", "gpu_mhz", "uplink_mbps", ...}], "clusters": [[ranks]], ...}``):
uplinks give the link rates (``rates``), clock rates the relative speeds, clusters the racks;
``latency_ms``, ``wake_ms`` and ``lanes`` added at its top level are read as above.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from convoy.emulation.topology import check_rate, parse_rate
from convoy.errors import UsageError
from convoy.sim.network import TCP_EFFICIENCY, Link

# The simulator is linear in the nodes, but a cluster past this is a typo, and
# per-node lists (speeds, profiles) of that length would not fit in memory.
MAX_NODES = 1_000_000

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Cluster:
    """Worker nodes and their network.

    Args:
        nodes: ranks, one per host.
        rate_bps: each host's link, bits/s (the slowest host's, if they differ).
        rates: each host's own link rate, bits/s, where they differ (the
            simulator models the slowest; emulated clusters shape each host's).
        racks: equal racks; a ring crosses the links between racks.
        inter_rack_bps: the rate of the link between racks (needed with racks > 1).
        latency_s: one-way latency per message.
        wake_s: a receiving thread's per-message time, hidden behind longer transfers
            (:class:`convoy.sim.network.Link`); milliseconds where ranks share busy cores.
        speeds: relative compute speed per node (1 = the machine the profile is
            from); a synchronous step runs at the slowest node's pace.
        cores: CPU cores each rank has, when that is what limits it (0.5 for 4
            emulated hosts on 2 cores); None: a core per thread (the main
            thread computes at the profile's speed, the auxiliary thread's
            updates and compression run beside it). Below one core the
            compute slows by 1/cores; below two, the auxiliary thread's and the
            network stack's CPU work is taken out of the step (``stolen_s``).
        efficiency: share of the link rate that is payload.
        lanes: collectives one process group runs at once: gloo's worker threads (2),
            NCCL's one stream per group (1). Their bytes share the link; their latencies overlap.

    Example::

        >>> c = Cluster(4, 100e6)
        >>> round(c.ring_link().bytes_per_s / 1e6, 2)   # MB/s of payload
        11.95
    """

    nodes: int
    rate_bps: float
    racks: int = 1
    inter_rack_bps: float | None = None
    latency_s: float = 0.0
    wake_s: float = 0.0
    speeds: tuple[float, ...] = field(default=())
    cores: float | None = None
    efficiency: float = TCP_EFFICIENCY
    name: str = ""
    lanes: int = 2
    rates: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"a cluster needs at least one node, got {self.nodes}")
        if self.nodes > MAX_NODES:
            raise UsageError(f"a cluster has at most {MAX_NODES} nodes, got {self.nodes}")
        if not all(math.isfinite(v) for v in (self.rate_bps, self.latency_s, self.wake_s)):
            raise UsageError("link rate, latency and wake-up must be finite numbers")
        if not self.rate_bps > 0:
            raise UsageError(f"link rate must be > 0, got {self.rate_bps} bit/s")
        if self.racks < 1 or self.nodes % self.racks:
            raise UsageError(f"racks must divide the {self.nodes} nodes, got {self.racks}")
        if self.racks > 1 and not (self.inter_rack_bps or 0) > 0:
            raise UsageError("a cluster with several racks needs an inter-rack rate > 0")
        if self.latency_s < 0 or self.wake_s < 0:
            raise UsageError(f"latency and wake-up must be >= 0, got latency {self.latency_s} s "
                             f"and wake-up {self.wake_s} s")
        if self.speeds and (len(self.speeds) != self.nodes or min(self.speeds) <= 0):
            raise UsageError(f"speeds needs {self.nodes} values > 0, got {list(self.speeds)}")
        if self.rates and (len(self.rates) != self.nodes or min(self.rates) != self.rate_bps):
            raise UsageError(f"rates needs {self.nodes} link rates, the slowest equal to rate, got {list(self.rates)}")
        if (self.cores is not None and not self.cores > 0) or not 0 < self.efficiency <= 1:
            raise UsageError("cores must be > 0 and efficiency in (0, 1]")
        if self.lanes < 1:
            raise UsageError(f"lanes must be >= 1 (gloo 2, NCCL 1), got {self.lanes}")

    def host_link(self) -> Link:
        return Link.from_bits(self.rate_bps, self.latency_s, self.efficiency, self.wake_s)

    def inter_rack_link(self) -> Link:
        return Link.from_bits(self.inter_rack_bps or self.rate_bps, self.latency_s, self.efficiency, self.wake_s)

    def ring_link(self) -> Link:
        """The bottleneck hop of a ring over all nodes: each rack boundary is crossed once each way."""
        if self.racks == 1:
            return self.host_link()
        return Link.from_bits(min(self.rate_bps, self.inter_rack_bps), self.latency_s, self.efficiency, self.wake_s)

    @property
    def slowdown(self) -> float:
        """How much longer a step's compute takes than in the profile (the slowest node sets the pace)."""
        return max(1.0, 1.0 / (self.cores or 1.0)) / self.speed

    @property
    def speed(self) -> float:
        return min(self.speeds) if self.speeds else 1.0

    def stolen_s(self, side_cpu_s: float) -> float:
        """Seconds a step loses to ``side_cpu_s`` of profile-speed CPU work off the main
        thread (auxiliary thread, network stack): none with two cores or more per rank,
        where that work runs beside the compute; all of it, at 1/cores, with fewer."""
        if self.cores is None or self.cores >= 2:
            return 0.0
        return side_cpu_s / self.cores / self.speed

    @property
    def shared_rate(self) -> float | None:
        """The speed of each of a rank's two busy threads against one alone, where the
        rank's cores are counted (``cores``): half below one core, 1 from two up."""
        if self.cores is None:
            return None
        return min(1.0, self.cores / 2) / min(1.0, self.cores)

    def with_active(self, active: int) -> "Cluster":
        """The cluster as ``active`` computing ranks see it: ranks that mostly wait (parameter
        servers, FC workers during the conv phase) leave their share of shared cores to them."""
        if self.cores is None or active >= self.nodes:
            return self
        return replace(self, cores=self.cores * self.nodes / active)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster from a TOML or JSON file (see the module doc for the keys).

    Raises:
        UsageError: missing file, unreadable contents, bad values.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"cluster file {path} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read cluster file {path}: {exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"cluster file {path} is not text; give a TOML or JSON file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" or text.lstrip().startswith("{") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot parse cluster file {path}: {exc}") from None
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        raise UsageError(f"cluster file {path} holds a {kind}; it must hold an object with nodes and rate "
                         "(or convoy profile-nodes --json output)")
    try:
        if isinstance(data.get("nodes"), list):
            return _from_node_profiles(data, path.stem)
        return _from_keys(data, path.stem)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"bad cluster file {path}: {exc!r}") from None


def _rate(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_rate(float(value), value)
    return parse_rate(str(value))


def _from_keys(data: dict, name: str) -> Cluster:
    known = {"nodes", "rate", "rates", "racks", "inter_rack_rate", "latency_ms", "wake_ms", "speeds", "cores", "name",
             "lanes"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"unknown cluster keys {unknown}; known: {', '.join(sorted(known))}")
    if ("rate" in data) == ("rates" in data):
        raise UsageError("give the links as rate (every host's) or rates (one per node), not both or neither")
    rates = tuple(_rate(r) for r in data.get("rates", ()))
    inter = data.get("inter_rack_rate")
    return Cluster(nodes=int(data["nodes"]), rate_bps=min(rates) if rates else _rate(data["rate"]),
                   rates=rates, racks=int(data.get("racks", 1)),
                   inter_rack_bps=_rate(inter) if inter is not None else None,
                   latency_s=float(data.get("latency_ms", 0.0)) / 1e3,
                   wake_s=float(data.get("wake_ms", 0.0)) / 1e3,
                   speeds=tuple(float(s) for s in data.get("speeds", ())),
                   cores=float(data["cores"]) if "cores" in data else None, name=str(data.get("name", name)),
                   lanes=int(data.get("lanes", 2)))


def _from_node_profiles(data: dict, name: str) -> Cluster:
    """``convoy profile-nodes --json``: per-node uplinks and clocks; clusters become racks."""
    nodes = sorted(data["nodes"], key=lambda n: int(n.get("rank", 0)))
    if not nodes:
        raise UsageError("the node profile lists no nodes")
    uplinks = [float(n["uplink_mbps"]) * 1e6 for n in nodes]
    if min(uplinks) <= 0:
        raise UsageError(f"every node's uplink_mbps must be > 0, got {min(uplinks) / 1e6}")
    # A GPU's clock when nodes have one, else the CPU's: relative to the fastest node.
    clock = "gpu_mhz" if all(float(n.get("gpu_mhz") or 0) > 0 for n in nodes) else "cpu_mhz"
    clocks = [float(n.get(clock) or 0) for n in nodes]
    speeds = tuple(c / max(clocks) for c in clocks) if min(clocks) > 0 else ()
    groups = data.get("clusters") or [[int(n.get("rank", i)) for i, n in enumerate(nodes)]]
    racks = len(groups) if len(nodes) % len(groups) == 0 and len({len(g) for g in groups}) == 1 else 1
    inter = data.get("inter_rack_mbps")
    return Cluster(nodes=len(nodes), rate_bps=min(uplinks), rates=tuple(uplinks), racks=racks,
                   inter_rack_bps=float(inter) * 1e6 if inter else (min(uplinks) if racks > 1 else None),
                   latency_s=float(data.get("latency_ms", 0.0)) / 1e3, wake_s=float(data.get("wake_ms", 0.0)) / 1e3,
                   speeds=speeds, name=name, lanes=int(data.get("lanes", 2)))
