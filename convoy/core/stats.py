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

    def record_times(self, wall_s: float, wait_s: float) -> None:
        """The step's backward ended ``wall_s`` after the previous one, ``wait_s`` of it blocked on communication."""
        self.wall_s, self.wait_s = wall_s, wait_s

    def record_bytes(self, sent: int, received: int) -> None:
        """The step's exchanges sent and received these payload bytes."""
        self.bytes_sent, self.bytes_received = sent, received

    @property
    def compute_s(self) -> float:
        return max(self.wall_s - self.wait_s, 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "compute_s": self.compute_s}
