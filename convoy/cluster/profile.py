"""Measuring a node's six indicators, and every node of a job.

Each rank measures its CPU clock, memory, GPU clock and memory (0 without a
GPU) and disk throughput (a timed write + fsync in a temporary directory);
uplink bandwidth is a timed transfer over the process group: every rank r > 0
sends a buffer to rank 0 (on request, so the clock runs only while the bytes
move), and rank 0 sends one to rank 1; the best of three tries counts (of two for
the disk), and how much the tries differed is kept as the node's measurement noise.
A ``--node-profile`` file replaces any of these values, and an indicator it gives is not measured.

A node is a machine, not a process: the ranks that share one (the same host
name and network namespace, so each emulated host is a node of its own) share
its measured CPU, memory, disk and uplink, those of its lowest rank. Measured
per process, they differed by the machine's load of the moment, and two runs of
one local job could be planned into different clusters.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from convoy.cluster.indicators import INDICATORS
from convoy.cluster.profile_file import ProfileOverrides

DISK_BYTES = 16 << 20
DISK_TRIES = 2
UPLINK_BYTES = 2 << 20
UPLINK_TRIES = 3
# The indicators of the machine itself, the same for every rank on it (the GPU ones are each rank's device's).
MACHINE_INDICATORS = ("cpu_mhz", "memory_gb", "disk_mbps", "uplink_mbps")


@dataclass
class NodeProfile:
    """One rank's indicators (units in :mod:`convoy.cluster.indicators`) and which came from a file."""

    rank: int
    host: str
    cpu_mhz: float = 0.0
    memory_gb: float = 0.0
    gpu_mhz: float = 0.0
    gpu_memory_gb: float = 0.0
    disk_mbps: float = 0.0
    uplink_mbps: float = 0.0
    from_file: tuple[str, ...] = ()
    # Per timed indicator, how much this node's own tries differed: (best - worst) / best.
    noise: dict[str, float] = field(default_factory=dict)

    def values(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in INDICATORS}

    def as_dict(self) -> dict:
        return {**asdict(self), "from_file": list(self.from_file)}


def cpu_mhz() -> float:
    """The CPU's maximum clock (current when the maximum is unknown), in MHz; 0 when unknown."""
    import psutil

    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, FileNotFoundError):
        freq = None
    if freq is not None and (freq.max or freq.current):
        return float(freq.max or freq.current)
    try:
        with open("/proc/cpuinfo") as f:
            clocks = [float(line.split(":")[1]) for line in f if line.lower().startswith("cpu mhz")]
        return max(clocks) if clocks else 0.0
    except OSError:
        return 0.0


def memory_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**30


def gpu_mhz_and_memory_gb(local_rank: int = 0) -> tuple[float, float]:
    """This rank's GPU clock (MHz) and memory (GiB); (0, 0) without one."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    device = local_rank % torch.cuda.device_count()
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        import pynvml  # optional: the clock is not in torch's device properties

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        return float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)), memory
    except Exception:  # no pynvml, or no NVML: the clock stays unknown
        return 0.0, memory


def disk_mbps(directory: str | None = None, nbytes: int = DISK_BYTES) -> float:
    """MB/s of writing ``nbytes`` to a new file in ``directory`` and fsyncing it."""
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="convoy-disk-") as f:
        start = time.perf_counter()
        for _ in range(max(nbytes // len(block), 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        elapsed = time.perf_counter() - start
    return max(nbytes, len(block)) / 1e6 / max(elapsed, 1e-9)


def spread(tries: list[float]) -> float:
    """How much repeated measurements of one thing differ: (best - worst) / best, 0 for none."""
    return (max(tries) - min(tries)) / max(tries) if tries and max(tries) > 0 else 0.0


def uplink_mbps(nbytes: int = UPLINK_BYTES, group: dist.ProcessGroup | None = None,
                tries: int = UPLINK_TRIES) -> list[float]:
    """Every rank's uplink in Mbit/s, the best of its tries (see :func:`uplink_tries`); a collective."""
    return [max(rates) for rates in uplink_tries(nbytes, group, tries)]


def uplink_tries(nbytes: int = UPLINK_BYTES, group: dist.ProcessGroup | None = None,
                 tries: int = UPLINK_TRIES) -> list[list[float]]:
    """Every rank's uplink in Mbit/s of each try, the same lists on every rank; a collective.

    Rank r > 0 is timed sending to rank 0, rank 0 sending to rank 1, one at a
    time so transfers do not share links. The receiver sends a one-byte
    request and times until the buffer has arrived (one round trip included);
    the best of ``tries`` transfers counts, since a busy host only ever makes
    a transfer slower.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rates = torch.zeros(world, tries, dtype=torch.float64)
    if world == 1:
        return rates.tolist()
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    for sender in range(world):
        receiver = 1 if sender == 0 else 0
        for attempt in range(tries):
            if rank == receiver:
                rates[sender, attempt] = _timed_receive(sender, payload, group)
            elif rank == sender:
                go = torch.zeros(1, dtype=torch.uint8)
                dist.recv(go, src=_global(receiver, group), group=group)
                dist.send(payload, dst=_global(receiver, group), group=group)
    # Rank 0 measured everyone but itself; rank 1 measured rank 0.
    rates_sum = rates.clone()
    dist.all_reduce(rates_sum, group=group)
    return rates_sum.tolist()


def _timed_receive(sender: int, buffer: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    go = torch.zeros(1, dtype=torch.uint8)
    start = time.perf_counter()
    dist.send(go, dst=_global(sender, group), group=group)
    dist.recv(buffer, src=_global(sender, group), group=group)
    return buffer.numel() * 8 / 1e6 / max(time.perf_counter() - start, 1e-9)


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def profile_job(overrides: ProfileOverrides | None = None, local_rank: int = 0,
                disk_dir: str | None = None) -> list[NodeProfile]:
    """Every rank's profile, the same list on every rank; a collective on the default group.

    Values given by ``overrides`` replace measurements (and are not measured).
    Raises UsageError on every rank alike when the file misses a rank or an indicator.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    hosts = _all_gather([socket.gethostname()], world)
    machines = _all_gather([machine_id()], world)
    given = [overrides.for_rank(r, hosts[r]) if overrides else {} for r in range(world)]
    measure = {
        "cpu_mhz": cpu_mhz,
        "memory_gb": memory_gb,
        "gpu_mhz": lambda: gpu_mhz_and_memory_gb(local_rank)[0],
        "gpu_memory_gb": lambda: gpu_mhz_and_memory_gb(local_rank)[1],
    }
    values = {name: given[rank][name] if name in given[rank] else how() for name, how in measure.items()}
    noise: dict[str, float] = {}
    if "disk_mbps" in given[rank]:
        values["disk_mbps"] = given[rank]["disk_mbps"]
    else:
        disk = [disk_mbps(disk_dir) for _ in range(DISK_TRIES)]
        values["disk_mbps"], noise["disk_mbps"] = max(disk), spread(disk)
    # The timed transfer is a collective: run it unless the file gives every rank's uplink.
    if any("uplink_mbps" not in g for g in given) and world > 1:
        uplink = uplink_tries()[rank]
        values["uplink_mbps"], noise["uplink_mbps"] = max(uplink), spread(uplink)
    if "uplink_mbps" in given[rank]:
        values["uplink_mbps"] = given[rank]["uplink_mbps"]
        noise.pop("uplink_mbps", None)   # a given value is exact
    mine = NodeProfile(rank, hosts[rank], **values, noise=noise,
                       from_file=tuple(name for name in INDICATORS if name in given[rank]))
    return one_profile_per_machine(_all_gather([mine], world), machines)


def machine_id() -> str:
    """What tells this process's machine from the job's others: its host name and network namespace."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:   # not Linux: the host name alone
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def one_profile_per_machine(profiles: list[NodeProfile], machines: list[str]) -> list[NodeProfile]:
    """New ``profiles`` with each machine's measured indicators those of its lowest rank measuring them.

    Values a profile file gave stay each rank's own (a file may set ranks of one host apart).

    Example::

        >>> a, b = NodeProfile(0, "h", cpu_mhz=2000.0), NodeProfile(1, "h", cpu_mhz=1900.0)
        >>> one_profile_per_machine([a, b], ["h/1", "h/1"])[1].cpu_mhz
        2000.0
    """
    leads: dict[tuple[str, str], NodeProfile] = {}   # (indicator, machine) -> the rank measuring it first
    out = []
    for profile, machine in zip(profiles, machines):
        values, noise = {}, dict(profile.noise)
        for name in MACHINE_INDICATORS:
            if name in profile.from_file:
                continue
            lead = leads.setdefault((name, machine), profile)
            values[name] = getattr(lead, name)
            if name in lead.noise:
                noise[name] = lead.noise[name]
        out.append(replace(profile, **values, noise=noise))
    return out


def _all_gather(item: list, world: int) -> list:
    if world == 1:
        return item
    out: list = [None] * world
    dist.all_gather_object(out, item[0])
    return out
