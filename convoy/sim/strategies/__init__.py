"""Simulated synchronisation strategies, one small class each behind :class:`Strategy`."""
from convoy.sim.strategies.allreduce import LayerRing
from convoy.sim.strategies.base import Breakdown, Strategy
from convoy.sim.strategies.ddp import TorchDDP
from convoy.sim.strategies.hierarchical import ClusterCycles
from convoy.sim.strategies.hybrid import ConvFcSplit
from convoy.sim.strategies.ps import ServerShards

__all__ = ["Breakdown", "ClusterCycles", "ConvFcSplit", "LayerRing", "ServerShards", "Strategy", "TorchDDP"]
