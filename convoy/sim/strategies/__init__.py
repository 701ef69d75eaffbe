"""Simulated synchronisation strategies, one small class each behind :class:`Strategy`."""
from convoy.sim.strategies.allreduce import AllReduce
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sim.strategies.ddp import DDP
from convoy.sim.strategies.hierarchical import Hierarchical
from convoy.sim.strategies.hybrid import Hybrid
from convoy.sim.strategies.ps import ParameterServer

__all__ = ["AllReduce", "Breakdown", "DDP", "Hierarchical", "Hybrid", "ParameterServer", "Strategy"]
