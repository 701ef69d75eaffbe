"""k-means over the nodes' weighted vectors, ``auto`` by silhouette."""
from __future__ import annotations

import warnings

import numpy as np

from convoy.errors import UsageError

AUTO_MAX_CLUSTERS = 8
DEFAULT_CLUSTERS = "auto"   # K chosen by silhouette unless given


def cluster_vectors(vectors: np.ndarray, clusters: int | str, seed: int = 0) -> list[list[int]]:
    """Partition the rows of ``vectors`` (one per rank) into clusters of ranks.

    Args:
        vectors: ``(nodes, indicators)`` weighted, normalised indicators.
        clusters: a count K (1 <= K <= nodes) or ``"auto"``: the K in
            2..min(nodes - 1, 8) with the best silhouette score, or 1 when the
            nodes are fewer than 3 or all alike.
        seed: k-means' random state; the same seed gives the same clusters.

    Returns the clusters in a canonical order: members ascending, clusters
    by their lowest rank, so the labels k-means happens to pick do not matter.
    When k-means finds fewer distinct groups than K (identical nodes), the
    largest cluster is split in halves by rank until there are K.

    Example::

        >>> cluster_vectors(np.array([[0.0], [0.1], [5.0], [5.1]]), 2)
        [[0, 1], [2, 3]]
    """
    nodes = len(vectors)
    if clusters == "auto":
        return _best_by_silhouette(vectors, seed)
    if not 1 <= int(clusters) <= nodes:
        raise UsageError(f"--clusters {clusters} is more than the {nodes} nodes" if int(clusters) > nodes
                         else f"--clusters must be >= 1, got {clusters}")
    return _kmeans(vectors, int(clusters), seed)


def _kmeans(vectors: np.ndarray, k: int, seed: int) -> list[list[int]]:
    if k == 1:
        return [list(range(len(vectors)))]
    from sklearn.cluster import KMeans

    with warnings.catch_warnings():
        # Fewer distinct points than K is handled below by splitting.
        warnings.simplefilter("ignore")
        labels = KMeans(n_clusters=k, random_state=seed, n_init=10).fit_predict(vectors)
    return _split_to(_canonical(labels), k)


def _best_by_silhouette(vectors: np.ndarray, seed: int) -> list[list[int]]:
    from sklearn.metrics import silhouette_score

    nodes = len(vectors)
    distinct = len(np.unique(vectors, axis=0))
    best, best_score = [list(range(nodes))], -1.0
    for k in range(2, min(nodes - 1, distinct, AUTO_MAX_CLUSTERS) + 1):
        groups = _kmeans(vectors, k, seed)
        labels = np.empty(nodes, dtype=int)
        for label, members in enumerate(groups):
            labels[members] = label
        score = silhouette_score(vectors, labels)
        if score > best_score:
            best, best_score = groups, score
    return best


def _canonical(labels: np.ndarray) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, label in enumerate(labels.tolist()):
        groups.setdefault(label, []).append(rank)
    return sorted(groups.values(), key=lambda members: members[0])


def _split_to(groups: list[list[int]], k: int) -> list[list[int]]:
    while len(groups) < k:
        largest = max(groups, key=len)   # the first of the largest: deterministic
        half = (len(largest) + 1) // 2
        groups.remove(largest)
        groups += [largest[:half], largest[half:]]
        groups.sort(key=lambda members: members[0])
    return groups


def parse_clusters(text: str | int) -> int | str:
    """``--clusters``: ``"auto"`` or a count >= 1."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        count = int(str(text).strip())
    except ValueError:
        raise UsageError(f"--clusters must be a number or auto, got {text!r}") from None
    if count < 1:
        raise UsageError(f"--clusters must be >= 1, got {count}")
    return count
