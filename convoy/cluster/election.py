"""Electing each cluster's temporary sync server, again every R cycles."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHOICES = ("random", "capable")
DEFAULT_CHOICE = "random"
DEFAULT_EVERY = 4   # R, exchange cycles one election lasts, unless given


@dataclass(frozen=True)
class Election:
    """Who serves each cluster in a given exchange cycle.

    Args:
        clusters: the clusters' ranks, in canonical order.
        every: R, the cycles one election lasts (re-election every R cycles).
        seed: fixes the random order; the same seed gives the same servers.
        choice: ``"random"`` (the default rotation): each cluster's members are
            put in an order drawn with the seed, and election e picks the
            member at position e mod size, so the role rotates through every
            member before any serves twice; ``"capable"``: always the member
            with the highest ``capability`` (ties: the lowest rank).
        capability: per rank, the sum of its weighted normalised indicators.

    Example::

        >>> Election([[0, 1], [2, 3]], every=2, seed=0).servers(cycle=0)
        [0, 2]
    """

    clusters: list[list[int]]
    every: int = DEFAULT_EVERY
    seed: int = 0
    choice: str = DEFAULT_CHOICE
    capability: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.choice not in CHOICES:
            raise ValueError(f"choice must be one of {CHOICES}, got {self.choice!r}")
        if self.choice == "capable" and len(self.capability) < sum(map(len, self.clusters)):
            raise ValueError("choice 'capable' needs a capability per rank")

    def epoch(self, cycle: int) -> int:
        """The election in force during exchange cycle ``cycle``."""
        return cycle // self.every

    def servers(self, cycle: int) -> list[int]:
        """Each cluster's server during exchange cycle ``cycle``."""
        return [self._server(index, members, self.epoch(cycle)) for index, members in enumerate(self.clusters)]

    def _server(self, index: int, members: list[int], epoch: int) -> int:
        if self.choice == "capable":
            return max(members, key=lambda rank: (self.capability[rank], -rank))
        order = np.random.default_rng([self.seed, index]).permutation(members)
        return int(order[epoch % len(members)])
