"""Emulated clusters on one machine: network namespaces, bridges, shaped links."""
from convoy.emulation.netns import (EmulatedCluster, check_available, leftover_namespaces, machine_congestion_control,
                                    remove_namespaces)
from convoy.emulation.topology import Topology, parse_rate

__all__ = ["EmulatedCluster", "Topology", "check_available", "leftover_namespaces", "machine_congestion_control",
           "parse_rate", "remove_namespaces"]
