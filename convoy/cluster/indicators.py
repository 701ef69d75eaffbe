"""The six node indicators and how much each counts by default.

Units: ``cpu_mhz`` and ``gpu_mhz`` in MHz, ``memory_gb`` and ``gpu_memory_gb``
in GiB, ``disk_mbps`` in MB/s (megabytes, a timed write + fsync), ``uplink_mbps``
in Mbit/s (megabits, like link rates). A node without a GPU has 0 for both GPU
indicators.
"""
from __future__ import annotations

from convoy.errors import UsageError

INDICATORS = ("cpu_mhz", "memory_gb", "gpu_mhz", "gpu_memory_gb", "disk_mbps", "uplink_mbps")

# Why these defaults: the uplink decides which nodes can share a synchronous
# group every batch without waiting on a slow link, so it counts twice; the
# CPU and GPU clocks decide who keeps pace within a batch (1 each); memory and
# disk shape a training step least (0.5 each).
DEFAULT_WEIGHTS: dict[str, float] = {"cpu_mhz": 1.0, "memory_gb": 0.5, "gpu_mhz": 1.0, "gpu_memory_gb": 0.5,
                                     "disk_mbps": 0.5, "uplink_mbps": 2.0}


def parse_weights(text: str | None) -> dict[str, float]:
    """Indicator weights from ``--indicator-weights``.

    Either ``name=value`` pairs (``"uplink_mbps=4,disk_mbps=0"``; indicators not
    named keep their default) or six numbers in the order of ``INDICATORS``.
    Weights must be >= 0 and not all zero.

    Example::

        >>> parse_weights("uplink_mbps=4")["uplink_mbps"]
        4.0
    """
    weights = dict(DEFAULT_WEIGHTS)
    if text:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if items and all("=" not in item for item in items):
            if len(items) != len(INDICATORS):
                raise UsageError(f"--indicator-weights needs {len(INDICATORS)} numbers "
                                 f"({', '.join(INDICATORS)}) or name=value pairs, got {text!r}")
            items = [f"{name}={value}" for name, value in zip(INDICATORS, items)]
        for item in items:
            name, _, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in INDICATORS:
                raise UsageError(f"unknown indicator {name!r} in --indicator-weights; "
                                 f"choose from: {', '.join(INDICATORS)}")
            try:
                weights[name] = float(value)
            except ValueError:
                raise UsageError(f"--indicator-weights: {name} must be a number, got {value.strip()!r}") from None
    negative = [name for name, w in weights.items() if not w >= 0]
    if negative:
        raise UsageError(f"--indicator-weights must be >= 0; {negative[0]} is {weights[negative[0]]}")
    if not any(weights.values()):
        raise UsageError("--indicator-weights are all zero; at least one indicator must count")
    return weights
