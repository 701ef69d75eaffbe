"""The scaling simulator: a training step's time for each strategy on a cluster (``convoy simulate``, ``convoy plan``).

Per-layer sizes and compute times (:mod:`convoy.sim.profile`) and a cluster
(:mod:`convoy.sim.cluster`) go in; each strategy (:mod:`convoy.sim.strategies`)
lays out its exchanges, and :mod:`convoy.sim.overlap` runs them against the
compute the way convoy's engine does.

Example::

    >>> from convoy.sim import Cluster, profile_model, LayerRing
    >>> LayerRing().step_time(profile_model("lenet", 32), Cluster(4, 100e6)).step_s
"""
from convoy.sim.cluster import Cluster, load_cluster
from convoy.sim.profile import ModelProfile, load_profile, profile_model
from convoy.sim.strategies import (Breakdown, ClusterCycles, ConvFcSplit, LayerRing, ServerShards, Strategy,
                                   TorchDDP)

__all__ = ["Breakdown", "Cluster", "ClusterCycles", "ConvFcSplit", "LayerRing", "ModelProfile", "ServerShards",
           "Strategy", "TorchDDP", "load_cluster", "load_profile", "profile_model"]
