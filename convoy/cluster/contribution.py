"""Weights of the inter-cluster exchange: each cluster's contribution over all earlier cycles.

The inter-cluster exchange weights the averages the clusters send by each
cluster's total contribution over all earlier exchange cycles. convoy scores how well a cluster's work agreed with the result of the exchange:

    a_j(c) = cos(D_j(c), D(c))       D_j(c): cluster j's parameter change over cycle c,
                                      D(c): the change the exchange applied (the weighted mean)
    A_j    = mean of a_j over all earlier cycles (1 before the first)
    w_j    = n_j max(A_j, 0) / sum_i n_i max(A_i, 0)     (n_j: cluster j's nodes)

Weights are >= 0 and sum to 1. When clusters agree (equal changes), every
cosine is 1 and w_j = n_j / N: plain size-weighted averaging. A cluster whose
updates keep pointing away from the consensus (bad data, a diverging replica)
loses weight; one that opposes it is ignored until it agrees again. If every
score is 0 the weights fall back to the size shares.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ContributionHistory:
    """Running agreement of every cluster, and the weights it implies.

    Args:
        sizes: nodes per cluster.

    Example::

        >>> history = ContributionHistory([1, 3])
        >>> history.weights()
        [0.25, 0.75]
        >>> history.record([1.0, -0.5]); history.weights()
        [1.0, 0.0]
    """

    sizes: list[int]
    agreement_sum: list[float] = field(default_factory=list)
    cycles: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes must be positive, got {self.sizes}")
        if not self.agreement_sum:
            self.agreement_sum = [0.0] * len(self.sizes)

    def size_shares(self) -> list[float]:
        total = sum(self.sizes)
        return [n / total for n in self.sizes]

    def weights(self) -> list[float]:
        """The weights of the next exchange: >= 0, summing to 1."""
        if self.cycles == 0:
            return self.size_shares()
        scores = [n * max(a / self.cycles, 0.0) for n, a in zip(self.sizes, self.agreement_sum)]
        total = sum(scores)
        if total <= 0:
            return self.size_shares()
        return [s / total for s in scores]

    def restore(self, agreement_sum: list[float], cycles: int) -> None:
        """Go on from a saved history: ``agreement_sum`` and ``cycles`` as it had them (a resume)."""
        if len(agreement_sum) != len(self.sizes):
            raise ValueError(f"need {len(self.sizes)} agreement sums, got {len(agreement_sum)}")
        self.agreement_sum, self.cycles = list(agreement_sum), cycles

    def record(self, agreements: list[float]) -> None:
        """Add one cycle's cosines ``a_j``, one per cluster."""
        if len(agreements) != len(self.sizes):
            raise ValueError(f"need {len(self.sizes)} agreements, got {len(agreements)}")
        self.agreement_sum = [s + min(max(a, -1.0), 1.0) for s, a in zip(self.agreement_sum, agreements)]
        self.cycles += 1
