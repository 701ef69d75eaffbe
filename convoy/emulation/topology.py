"""What an emulated cluster looks like: hosts, racks, and the rate of each link."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from convoy.errors import UsageError

# RFC 2544 reserves 198.18.0.0/15 for network benchmarks: these addresses
# never mean a real machine, and they exist only inside our namespaces.
SUBNET = "198.18.0"

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


# Link rates convoy accepts, in bits/s: tc shapes in whole bytes per second, and a
# slower or faster link than these is a typo (0.5bit for 0.5gbit), not a network.
MIN_RATE, MAX_RATE = 1e3, 1e12


def parse_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits/s (tc's spelling: kbit, mbit, gbit; bit/s without a unit).

    Raises:
        UsageError: not a rate, or outside 1kbit..1000gbit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit)?\s*", text.lower())
    if not match:
        raise UsageError(f"bad link rate {text!r}; write it like 100mbit, 1gbit or 500kbit")
    return check_rate(float(match.group(1)) * _UNITS[match.group(2)], text)


def check_rate(bits_per_s: float, text: object) -> float:
    """``bits_per_s`` if it lies in MIN_RATE..MAX_RATE, else a UsageError quoting ``text``."""
    if not MIN_RATE <= bits_per_s <= MAX_RATE:   # also false for NaN
        raise UsageError(f"link rate {text!r} is out of range; give 1kbit to 1000gbit, e.g. 100mbit or 1gbit")
    return bits_per_s


@dataclass(frozen=True)
class Topology:
    """``hosts`` hosts in ``racks`` equal racks, each host on a link of ``host_rate`` bits/s;
    racks joined by one link of ``inter_rack_rate`` bits/s.

    ``speeds`` (optional, one per host) makes hosts compute slower than the
    fastest: a host of speed 0.25 next to hosts of speed 1 gets a quarter of
    their share of the machine's cores (a straggler). ``host_rates`` (optional,
    one per host, bits/s) gives hosts links of their own rates instead of
    ``host_rate`` (a host on a slower link). ``own_cores`` caps every host at
    its even share of the cores, as if each were a machine of its own: the
    hosts then cannot lend each other CPU, and a host that is lost takes its
    share with it (without it, the survivors of a failure get the lost host's
    cores, which no real cluster gives them).

    Example::

        >>> Topology(hosts=4, host_rate=1e9, racks=2, inter_rack_rate=50e6).rack_of(3)
        1
        >>> Topology(hosts=4, host_rate=1e8, speeds=(1, 1, 1, 0.25)).relative_speed(3)
        0.25
        >>> Topology(hosts=2, host_rate=1e8, host_rates=(1e8, 25e6)).rate_of(1)
        25000000.0
    """

    hosts: int
    host_rate: float
    racks: int = 1
    inter_rack_rate: float | None = None
    speeds: tuple[float, ...] = field(default=())
    host_rates: tuple[float, ...] = field(default=())
    own_cores: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise UsageError(f"--hosts must be between 1 and 250, got {self.hosts}")
        if self.racks < 1 or self.hosts % self.racks:
            raise UsageError(f"--racks must divide --hosts ({self.hosts}), got {self.racks}")
        if self.racks > 1 and self.inter_rack_rate is None:
            raise UsageError("--inter-rack-rate is required with more than one rack")
        if self.host_rate <= 0 or (self.inter_rack_rate is not None and self.inter_rack_rate <= 0):
            raise UsageError("link rates must be > 0")
        if self.speeds and (len(self.speeds) != self.hosts or not min(self.speeds) > 0):
            raise UsageError(f"speeds needs one value > 0 per host ({self.hosts}), got {list(self.speeds)}")
        if self.host_rates and (len(self.host_rates) != self.hosts or not min(self.host_rates) > 0):
            raise UsageError(f"rates needs one link rate > 0 per host ({self.hosts}), got {list(self.host_rates)}")

    def rate_of(self, host: int) -> float:
        """The rate of ``host``'s link, bits/s."""
        return self.host_rates[host] if self.host_rates else self.host_rate

    def capped(self, host: int) -> bool:
        """Whether ``host`` runs under a CPU cap (slower than the fastest, or every host with ``own_cores``)."""
        return self.own_cores or self.relative_speed(host) < 1

    def relative_speed(self, host: int) -> float:
        """``host``'s compute speed against the fastest host's (1.0 without ``speeds``)."""
        return self.speeds[host] / max(self.speeds) if self.speeds else 1.0

    def rack_of(self, host: int) -> int:
        return host // (self.hosts // self.racks)

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"
