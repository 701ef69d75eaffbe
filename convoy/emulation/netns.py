"""Emulated hosts: Linux network namespaces on bridges, links shaped with tc.

One "switch" namespace holds a bridge per rack; each host namespace has an
``eth0`` whose peer is a port of its rack's bridge; racks are joined by one
veth pair between their bridges. Every link is shaped in both directions with
a token-bucket filter (tbf) on the egress of both of its ends. A host slower
than the others (``Topology.speeds``), or every host with
``Topology.own_cores``, runs under a CPU cap (:mod:`convoy.emulation.cpu`). A host's TCP congestion control is the
machine's unless one is named (it is a setting of each namespace, and how
well several flows share a shaped link depends on it). Nothing touches the
machine's own namespace, and everything is removed on exit.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Sequence

import psutil

from convoy.emulation.cpu import CpuCap
from convoy.emulation.topology import Topology
from convoy.errors import UsageError

PREFIX = "convoy"
_CONGESTION = "net.ipv4.tcp_congestion_control"
_AVAILABLE_CONGESTION = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def check_available() -> None:
    """Raise UsageError unless this process may build namespaces (root, iproute2)."""
    if os.geteuid() != 0:
        raise UsageError("emulated clusters need root (network namespaces); run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"emulated clusters need iproute2; not found: {', '.join(missing)}")


def machine_congestion_control() -> str:
    """The TCP congestion control of this machine's namespace (what emulated hosts inherit)."""
    return Path("/proc/sys", *_CONGESTION.split(".")).read_text().strip()


def check_congestion_control(name: str) -> None:
    """Raise UsageError unless ``name`` is a TCP congestion control this kernel has loaded."""
    available = Path(_AVAILABLE_CONGESTION).read_text().split()
    if name not in available:
        raise UsageError(f"unknown TCP congestion control {name!r}; this kernel has: {', '.join(available)}")


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _shape(ns: str, dev: str, rate: float) -> None:
    # A burst of at least 4 ms of traffic (and one jumbo frame) keeps tbf
    # accurate at the kernel's timer resolution.
    burst = max(int(rate / 8 * 0.004), 16_000)
    _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms")


class EmulatedCluster:
    """Builds the namespaces of ``topology`` on enter and removes them on exit.

    Args:
        topology: the hosts, their links and speeds.
        tag: prefix of the namespaces' names (default: ``convoy`` and this process's id).
        congestion_control: every host's TCP congestion control, e.g. ``cubic``; ``None``: the machine's.

    Example::

        >>> with EmulatedCluster(Topology(hosts=2, host_rate=100e6), congestion_control="cubic") as cluster:
        ...     subprocess.run(cluster.exec_prefix(0) + ["ip", "addr"])
    """

    def __init__(self, topology: Topology, tag: str | None = None, congestion_control: str | None = None):
        if congestion_control is not None:
            check_congestion_control(congestion_control)
        self.topology, self.congestion_control = topology, congestion_control
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.namespaces: list[str] = []
        self.caps: dict[int, CpuCap] = {}

    def host_ns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def exec_prefix(self, host: int) -> list[str]:
        """Prefix a command with this to run it on ``host`` (under its CPU cap, if it is slower)."""
        cap = self.caps.get(host)
        # The cap first: `ip netns exec` mounts a fresh /sys, without the cgroup file systems.
        return (cap.prefix() if cap else []) + ["ip", "netns", "exec", self.host_ns(host)]

    def pids(self, host: int) -> list[int]:
        """The ids of every process running on ``host`` (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", self.host_ns(host)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process on ``host`` at once, as a power cut ends them all; the ids killed.

        A process that ended meanwhile is passed over; the namespace and its links stay, so the
        host can run processes again (a replacement machine at the same address).
        """
        killed = []
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def __enter__(self) -> "EmulatedCluster":
        check_available()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        topo = self.topology
        self._add_ns(self.switch)
        for rack in range(topo.racks):
            _run("ip", "-n", self.switch, "link", "add", "name", f"br{rack}", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", f"br{rack}", "up")
        for rack in range(1, topo.racks):
            self._link_racks(0, rack)
        for host in range(topo.hosts):
            self._add_host(host)
        self._cap_hosts()

    def _cap_hosts(self) -> None:
        share = len(os.sched_getaffinity(0)) / self.topology.hosts   # an even share of the cores
        for host in range(self.topology.hosts):
            if self.topology.capped(host):
                speed = self.topology.relative_speed(host)
                self.caps[host] = CpuCap(f"{self.tag}-h{host}", speed * share).__enter__()

    def _add_host(self, host: int) -> None:
        ns, port = self.host_ns(host), f"h{host}"
        self._add_ns(ns)
        _run("ip", "-n", self.switch, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0",
             "netns", ns)
        _run("ip", "-n", self.switch, "link", "set", port, "master", f"br{self.topology.rack_of(host)}", "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.topology.address(host)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        if self.congestion_control is not None:
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{_CONGESTION}={self.congestion_control}")
        _shape(ns, "eth0", self.topology.rate_of(host))
        _shape(self.switch, port, self.topology.rate_of(host))

    def _link_racks(self, a: int, b: int) -> None:
        end_a, end_b = f"r{a}to{b}", f"r{b}to{a}"
        _run("ip", "-n", self.switch, "link", "add", "name", end_a, "type", "veth", "peer", "name", end_b)
        for end, rack in ((end_a, a), (end_b, b)):
            _run("ip", "-n", self.switch, "link", "set", end, "master", f"br{rack}", "up")
            _shape(self.switch, end, self.topology.inter_rack_rate)

    def teardown(self) -> None:
        """Delete every namespace made (their links go with them) and CPU cap; never raises."""
        for cap in self.caps.values():
            cap.remove()
        self.caps.clear()
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.namespaces.clear()


def leftover_namespaces() -> list[str]:
    """Namespaces of earlier runs that did not get to tear down (killed with SIGKILL).

    A namespace is named after the process that made it; those of processes
    still alive belong to clusters in use and are left alone.
    """
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith(PREFIX)]
    return [name for name in names if not _owner_alive(name)]


def _owner_alive(name: str) -> bool:
    owner = name[len(PREFIX):].split("-", 1)[0]
    return owner.isdigit() and psutil.pid_exists(int(owner))


def remove_namespaces(names: Sequence[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
