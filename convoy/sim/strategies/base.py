"""What every simulated strategy answers: one step's time and where it goes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from convoy.sim.cluster import Cluster
from convoy.sim.overlap import StepTrace
from convoy.sim.profile import ModelProfile


@dataclass(frozen=True)
class Breakdown:
    """One predicted training step.

    Attributes:
        strategy: the strategy's label.
        step_s: seconds per step in steady state (averaged over a cycle where
            there is one, e.g. hierarchical's exchange every T steps).
        compute_s: forward + backward + update on the slowest worker: the step
            with free communication.
        wire_s: seconds the exchanges keep the network busy, hidden or not.
        sent_bytes: bytes one worker sends per step.
        notes: strategy-specific figures (e.g. the cycle's longest step).
    """

    strategy: str
    step_s: float
    compute_s: float
    wire_s: float
    sent_bytes: float
    notes: dict = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        """Communication that compute did not hide."""
        return max(0.0, self.step_s - self.compute_s)

    @classmethod
    def from_timeline(cls, strategy: str, t: StepTrace, cluster: Cluster, sent_bytes: float,
                      ns_per_byte: float, **notes: object) -> "Breakdown":
        """A breakdown of the timeline ``t`` (simulated with compute slowed by
        ``cluster.slowdown``), plus what the side work steals where cores are short.

        The network stack's work is ``ns_per_byte`` for every byte sent and received,
        and steals only while the main thread computes (``t.busy_wire_share``); the
        auxiliary thread's steals too, unless the timeline already shared the CPU.
        """
        aux = 0.0 if t.aux_shared else t.aux_s / cluster.slowdown
        side = aux + 2 * sent_bytes * ns_per_byte * 1e-9 * t.busy_wire_share
        stolen = cluster.stolen_s(side)
        notes = {"forward_wait_s": t.forward_wait_s, **notes}
        if stolen:
            notes["cpu_stolen_s"] = stolen
        return cls(strategy, t.step_s + stolen, t.compute_s, t.wire_s, sent_bytes, notes)

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "step_s": self.step_s, "compute_s": self.compute_s,
                "wire_s": self.wire_s, "exposed_s": self.exposed_s, "sent_MB": self.sent_bytes / 1e6,
                **self.notes}


class Strategy(ABC):
    """A way to synchronise training, as the simulator models it.

    ``flags()`` gives the ``convoy train`` flags that run it; ``peer`` strategies
    (torch DDP and its PowerSGD hook) are not convoy's and run from
    ``bench/peers/ddp_train.py`` instead.
    """

    peer: bool = False

    @property
    @abstractmethod
    def label(self) -> str:
        """A short name for tables, e.g. ``allreduce topk 0.01``."""

    @abstractmethod
    def step_time(self, profile: ModelProfile, cluster: Cluster) -> Breakdown:
        """The steady-state step of ``profile`` trained on ``cluster``."""

    @abstractmethod
    def flags(self) -> list[str]:
        """``convoy train`` flags (or the peer script's) that select this strategy."""

    def workers(self, cluster: Cluster) -> int:
        """Ranks that train on data (all of them, unless some only serve)."""
        return cluster.nodes
