"""Heterogeneity-aware clustering of nodes: profile, normalise, weight, k-means, elect.

The pieces, one idea per module:

- :mod:`~convoy.cluster.indicators`: the six indicators and their default weights.
- :mod:`~convoy.cluster.profile`: measuring a node (and the whole job's nodes).
- :mod:`~convoy.cluster.profile_file`: ``--node-profile FILE`` overrides.
- :mod:`~convoy.cluster.normalise`: historical min/avg/max normalisation.
- :mod:`~convoy.cluster.clustering`: k-means over the weighted vectors, ``auto`` by silhouette.
- :mod:`~convoy.cluster.election`: the temporary sync server of each cluster, re-elected every R cycles.
- :mod:`~convoy.cluster.contribution`: the weights of the inter-cluster exchange.
- :mod:`~convoy.cluster.plan`: all of it on rank 0, broadcast so every rank agrees.
"""
from convoy.cluster.clustering import DEFAULT_CLUSTERS, cluster_vectors, parse_clusters
from convoy.cluster.contribution import ContributionHistory
from convoy.cluster.election import CHOICES as SERVER_CHOICES, DEFAULT_CHOICE as DEFAULT_SERVER_CHOICE, Election
from convoy.cluster.election import DEFAULT_EVERY as DEFAULT_REELECT_EVERY
from convoy.cluster.indicators import DEFAULT_WEIGHTS, INDICATORS, parse_weights
from convoy.cluster.normalise import IndicatorHistory
from convoy.cluster.plan import ClusterPlan, make_plan, plan_job
from convoy.cluster.profile import NodeProfile
from convoy.cluster.profile_file import ProfileOverrides, load_profile_file

__all__ = ["DEFAULT_CLUSTERS", "DEFAULT_REELECT_EVERY", "DEFAULT_SERVER_CHOICE", "DEFAULT_WEIGHTS", "INDICATORS",
           "SERVER_CHOICES", "ClusterPlan", "ContributionHistory", "Election", "IndicatorHistory", "NodeProfile",
           "ProfileOverrides", "cluster_vectors", "load_profile_file", "make_plan", "parse_clusters", "parse_weights",
           "plan_job"]
