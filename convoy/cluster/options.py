"""Checks of the clustering options shared by ``convoy train`` and ``convoy profile-nodes``."""
from __future__ import annotations

from convoy.cluster.clustering import DEFAULT_CLUSTERS, parse_clusters
from convoy.cluster.election import CHOICES, DEFAULT_CHOICE, DEFAULT_EVERY
from convoy.cluster.indicators import parse_weights
from convoy.cluster.profile_file import load_profile_file
from convoy.errors import UsageError


def check_cluster_options(world: int, clusters: str = DEFAULT_CLUSTERS, indicator_weights: str | None = None,
                          node_profile: str | None = None, reelect_every: int = DEFAULT_EVERY,
                          server_choice: str = DEFAULT_CHOICE) -> None:
    """Raise UsageError for the first bad option of a job of ``world`` ranks (before any worker starts)."""
    if reelect_every < 1:
        raise UsageError(f"--reelect-every must be >= 1, got {reelect_every}")
    if server_choice not in CHOICES:
        raise UsageError(f"unknown --server-choice {server_choice!r}; choose one of: {', '.join(CHOICES)}")
    parse_weights(indicator_weights)
    count = parse_clusters(clusters)
    if count != "auto" and count > world:
        raise UsageError(f"--clusters {count} is more than the {world} nodes")
    if node_profile is not None:
        load_profile_file(node_profile).check_world(world)
