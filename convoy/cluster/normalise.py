"""Normalising indicators with their historical maximum, average and minimum.

Per indicator, the highest value x_max, the average x_avg and the lowest value
x_min seen over past exchange cycles are kept. convoy uses mean normalisation, the one formula that needs all three,
on a log scale::

    v  = log2(1 + x)
    x' = (v - v_avg) / (v_max - v_min)        (0 when v_max == v_min)

so every indicator lies in [-1, 1] whatever its unit (MHz, GiB, Mbit/s), with
0 at the historical average: an indicator that does not vary across nodes
contributes nothing to the distances k-means works with. The log scale makes
ratios count, not differences: capacities span orders of magnitude (a 50
Mbit/s uplink against 1 Gbit/s), and measuring a fast link is noisy (400 or
900 Mbit/s on a busy host); on a linear scale that noise can outweigh the gap
to the slow links, on a log scale it cannot. The history holds every value
recorded for the indicator, over all nodes and profiling rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from convoy.cluster.indicators import INDICATORS


def log_scale(value: float) -> float:
    """``log2(1 + value)``: 0 stays 0 (no GPU), doubling a large value adds about 1."""
    return math.log2(1.0 + max(value, 0.0))


@dataclass
class IndicatorHistory:
    """Running max, sum, count and min of every indicator, on the log scale ``log2(1 + x)``.

    Example::

        >>> history = IndicatorHistory()
        >>> history.record([{"cpu_mhz": 1.0}, {"cpu_mhz": 7.0}])    # log2(1 + x): 1 and 3
        >>> history.normalise({"cpu_mhz": 7.0})["cpu_mhz"]
        0.5
    """

    maximum: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    minimum: dict[str, float] = field(default_factory=dict)

    def record(self, rows: list[dict[str, float]]) -> None:
        """Add one profiling round: one ``{indicator: value}`` row per node."""
        for row in rows:
            for name, raw in row.items():
                if name not in INDICATORS:
                    continue
                value = log_scale(raw)
                self.maximum[name] = max(self.maximum.get(name, value), value)
                self.minimum[name] = min(self.minimum.get(name, value), value)
                self.total[name] = self.total.get(name, 0.0) + value
                self.count[name] = self.count.get(name, 0) + 1

    def average(self, name: str) -> float:
        return self.total[name] / self.count[name]

    def normalise(self, row: dict[str, float]) -> dict[str, float]:
        """``row`` mapped to ``(x - x_avg) / (x_max - x_min)`` per recorded indicator."""
        out = {}
        for name, raw in row.items():
            if name not in self.count:
                continue
            value = log_scale(raw)
            spread = self.maximum[name] - self.minimum[name]
            out[name] = (value - self.average(name)) / spread if spread > 0 else 0.0
        return out
