"""From profiles to clusters and servers, computed once on rank 0 and broadcast."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from convoy.cluster.clustering import DEFAULT_CLUSTERS, cluster_vectors
from convoy.cluster.election import DEFAULT_CHOICE, DEFAULT_EVERY, Election
from convoy.cluster.indicators import INDICATORS
from convoy.cluster.normalise import IndicatorHistory
from convoy.cluster.profile import NodeProfile, profile_job
from convoy.cluster.profile_file import ProfileOverrides
from convoy.errors import UsageError


@dataclass
class ClusterPlan:
    """The job's nodes, their clusters and the rule that elects each cluster's server.

    ``normalised[r]`` is rank r's indicators after normalisation, in the order
    of ``INDICATORS``; k-means ran on them times ``weights``.

    Example::

        >>> plan = make_plan(profiles, weights, clusters="auto")
        >>> plan.cluster_of(3), plan.servers(cycle=0)
    """

    profiles: list[NodeProfile]
    weights: dict[str, float]
    normalised: list[list[float]]
    clusters: list[list[int]]
    election: Election
    history: IndicatorHistory = field(default_factory=IndicatorHistory)
    # Set when the measured split was within the measurements' noise: what it was, and why the
    # nodes were planned as alike instead (``make_plan``).
    noise_note: str | None = None

    def cluster_of(self, rank: int) -> int:
        return next(index for index, members in enumerate(self.clusters) if rank in members)

    def servers(self, cycle: int = 0) -> list[int]:
        return self.election.servers(cycle)

    def on_ranks(self, ranks: list[int]) -> "ClusterPlan":
        """This plan for a part of the job whose i-th node is global rank ``ranks[i]``.

        A plan is made over positions 0..n-1 of the profiles it is given; a
        hybrid job plans its conv group and its FC group separately, and each
        group's strategy talks to global ranks.

        Example::

            >>> plan.clusters, plan.on_ranks([4, 5, 6]).clusters
            ([[0, 2], [1]], [[4, 6], [5]])
        """
        clusters = [[ranks[i] for i in members] for members in self.clusters]
        capability = {ranks[i]: value for i, value in enumerate(self.election.capability)}
        return self.with_clusters(clusters, capability)

    def with_clusters(self, clusters: list[list[int]], capability: dict[int, float]) -> "ClusterPlan":
        """This plan with other clusters (and the per-rank capability the ``capable`` election reads)."""
        # The election indexes capability by rank: ranks outside the plan get 0.
        by_rank = tuple(capability.get(r, 0.0) for r in range(max(max(m) for m in clusters) + 1))
        election = Election(clusters, self.election.every, self.election.seed, self.election.choice, by_rank)
        return replace(self, clusters=clusters, election=election)

    def ranks(self) -> list[int]:
        """Every rank of the plan, in cluster order."""
        return [r for members in self.clusters for r in members]

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The clusters and the capabilities as tensors (``members``, ``sizes``, ``capability``),
        what a checkpoint keeps so that a resumed job keeps its clusters.

        Example::

            >>> clusters_from_tensors(plan.as_tensors()) == (plan.clusters, capability)
        """
        members = self.ranks()
        capability = self.election.capability
        return {"members": torch.tensor(members, dtype=torch.int64),
                "sizes": torch.tensor([len(m) for m in self.clusters], dtype=torch.int64),
                "capability": torch.tensor([capability[r] if r < len(capability) else 0.0 for r in members],
                                           dtype=torch.float64)}

    def as_json(self) -> dict:
        """The schema of ``convoy profile-nodes --json``."""
        nodes = [{**p.as_dict(), "normalised": n, "cluster": self.cluster_of(p.rank)}
                 for p, n in zip(self.profiles, self.normalised)]
        return {"nodes": nodes, "weights": self.weights, "clusters": self.clusters, "servers": self.servers(0),
                "server_choice": self.election.choice, "reelect_every": self.election.every,
                "noise_warning": self.noise_warning()}

    def noise_warning(self) -> str | None:
        """A sentence when the clusters differ by no more than the measurements' own noise, else None.

        For every weighted indicator, the clusters' means are compared: their
        gap, (largest - smallest) / largest, against the noise, the largest
        spread of one node's repeated tries of it (0 for values that are not
        timed or come from a file). When no gap exceeds its noise, the split
        is the noise's, and the nodes are probably alike (:func:`make_plan`
        then plans them as alike, and this says so).
        """
        if self.noise_note is not None:
            return self.noise_note
        if len(self.clusters) < 2:
            return None
        worst = None
        for name in INDICATORS:
            if self.weights.get(name, 0) <= 0:
                continue
            means = [float(np.mean([getattr(self.profiles[r], name) for r in members])) for members in self.clusters]
            gap = (max(means) - min(means)) / max(means) if max(means) > 0 else 0.0
            noise = max(p.noise.get(name, 0.0) for p in self.profiles)
            if gap > noise:
                return None
            if gap > 0 and (worst is None or gap > worst[1]):
                worst = (name, gap, noise)
        detail = f" (largest: {worst[0]} {worst[1]:.0%}, while a node's own tries differed by {worst[2]:.0%})" \
            if worst else ""
        return (f"the {len(self.clusters)} clusters differ by less than the measurement noise{detail}; "
                "the nodes are probably alike: consider --clusters 1")


def clusters_from_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list[list[int]], dict[int, float]]:
    """The clusters and per-rank capability of :meth:`ClusterPlan.as_tensors`."""
    members = tensors["members"].tolist()
    clusters, start = [], 0
    for size in tensors["sizes"].tolist():
        clusters.append(members[start:start + size])
        start += size
    return clusters, dict(zip(members, tensors["capability"].tolist()))


def make_plan(profiles: list[NodeProfile], weights: dict[str, float], clusters: int | str = DEFAULT_CLUSTERS,
              seed: int = 0, reelect_every: int = DEFAULT_EVERY,
              server_choice: str = DEFAULT_CHOICE) -> ClusterPlan:
    """Normalise, weight, cluster and set up the election; the same inputs give the same plan.

    When the clusters k-means finds differ by no more than the measurements' own
    noise (:meth:`ClusterPlan.noise_warning`), the split is the noise's: another
    run of the same job would measure other noise and split the nodes otherwise,
    so it would train differently (and an uninterrupted run would not match a
    resumed one). The nodes are then planned as the alike nodes they are: every
    weighted vector equal, so ``K`` clusters of consecutive ranks (``auto``: one),
    the same in every run; the plan's warning says so.

    Args:
        profiles: one per rank, in rank order.
        weights: per indicator, >= 0 (see :func:`convoy.cluster.indicators.parse_weights`).
        clusters: K or ``"auto"`` (see :func:`convoy.cluster.clustering.cluster_vectors`).
        seed: k-means' random state and the election's order.
        reelect_every: R, exchange cycles between elections.
        server_choice: ``"random"`` or ``"capable"`` (see :class:`convoy.cluster.election.Election`).
    """
    history = IndicatorHistory()
    rows = [p.values() for p in profiles]
    history.record(rows)
    normalised = [[history.normalise(row)[name] for name in INDICATORS] for row in rows]
    scale = np.array([weights[name] for name in INDICATORS])
    vectors = np.array(normalised) * scale
    groups = cluster_vectors(vectors, clusters, seed)
    capability = tuple(float(v) for v in vectors.sum(axis=1))
    election = Election(groups, reelect_every, seed, server_choice, capability)
    plan = ClusterPlan(profiles, dict(weights), normalised, groups, election, history)
    noise = plan.noise_warning()
    if noise is None:
        return plan
    alike = np.zeros_like(vectors)
    groups = cluster_vectors(alike, clusters, seed)
    election = Election(groups, reelect_every, seed, server_choice, tuple(0.0 for _ in profiles))
    note = (f"{noise}; planned as alike nodes instead of splitting them by noise (clusters {plan.clusters} "
            f"measured, {groups} used: the same in every run)")
    return ClusterPlan(profiles, dict(weights), normalised, groups, election, history, noise_note=note)


def plan_job(weights: dict[str, float], clusters: int | str = DEFAULT_CLUSTERS, seed: int = 0,
             reelect_every: int = DEFAULT_EVERY, server_choice: str = DEFAULT_CHOICE, overrides: ProfileOverrides | None = None,
             local_rank: int = 0) -> ClusterPlan:
    """Profile every rank, plan on rank 0, broadcast: every rank returns the same plan; a collective."""
    profiles = profile_job(overrides, local_rank)
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list = [None]
    if rank == 0:
        try:
            box[0] = make_plan(profiles, weights, clusters, seed, reelect_every, server_choice)
        except UsageError as exc:   # sent on, so every rank fails alike instead of waiting
            box[0] = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise UsageError(box[0])
    return box[0]
