"""Emulated clusters on one machine: network namespaces, bridges, shaped links."""
from convoy.emulation.netns import EmulatedCluster, check_available, leftover_namespaces, remove_namespaces
from convoy.emulation.stragglers import Stragglers
from convoy.emulation.topology import Topology, parse_rate

__all__ = ["EmulatedCluster", "Stragglers", "Topology", "check_available", "leftover_namespaces", "parse_rate",
           "remove_namespaces"]
