"""Per-step accounting: where a worker's time and bytes went."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepStats:
    """What one worker spent on one step.

    ``wall_s`` runs from the end of the previous ``backward`` to the end of this
    one; ``wait_s`` is the part of it the main thread spent blocked on
    communication (a layer's update not yet applied); ``compute_s`` is the rest.
    Bytes are counted by the sync strategy from what it actually transmits.
    """

    step: int
    wall_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def compute_s(self) -> float:
        return max(self.wall_s - self.wait_s, 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "compute_s": self.compute_s}
