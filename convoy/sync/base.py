"""The sync-strategy interface: how a layer's gradient becomes the averaged gradient."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

from convoy.engine.layers import Bucket


class PendingSync(ABC):
    """An exchange in flight for one layer."""

    @abstractmethod
    def is_done(self) -> bool:
        """True once ``wait`` would not block."""

    @abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the exchange ends; return the averaged flat gradient."""

    def future(self) -> torch.futures.Future:
        """A torch Future of the averaged flat gradient (what a DDP comm hook returns).

        This default waits first; exchanges backed by a collective override it
        so the result is computed when the collective completes.
        """
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(self.wait())
        return done


class SyncStrategy(ABC):
    """Exchanges each layer's gradient with the other workers.

    The engine calls ``start`` from its auxiliary thread, once per bucket of
    layers per step, in the same order on every rank, and ``wait``s on the results
    in that order. Implementations count the payload bytes they put on and take
    off the wire with ``_count``.
    """

    world_size: int = 1  # ranks the strategy averages over (its group's size)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    @abstractmethod
    def start(self, bucket: Bucket, grad: torch.Tensor) -> PendingSync:
        """Begin exchanging ``grad``, the flat local gradient of ``bucket``'s layers."""

    def set_step(self, step: int) -> None:
        """The next exchange belongs to ``step`` (resuming); strategies with step-dependent behaviour override."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's exchange state that a bit-identical resume needs, by stable name.

        Checkpoints keep it in the rank's own file and hand it back through
        :meth:`load_state_tensors`. The default is the error-feedback residuals
        of a ``memory`` attribute (``residual.<bucket>``); strategies with more
        state (a compressor's warm-start factors, a cluster plan, exchange
        counters as tensors) extend the dict.
        """
        residuals = getattr(getattr(self, "memory", None), "residuals", None)
        if not isinstance(residuals, dict):
            return {}
        return {f"residual.{key}": value for key, value in residuals.items() if isinstance(value, torch.Tensor)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`state_tensors` returned (copies owned by the strategy from now on)."""
        residuals = getattr(getattr(self, "memory", None), "residuals", None)
        for key, tensor in tensors.items():
            kind, name = key.split(".", 1)
            if kind == "residual" and isinstance(residuals, dict):
                residuals[name] = tensor.clone()

    def state_bytes_bound(self, params_bytes: int) -> int:
        """At most how many bytes :meth:`state_tensors` will hold (a checkpoint reserves disk for it).

        The default allows residuals as large as the parameters whenever the
        strategy keeps an error-feedback memory.
        """
        residuals = getattr(getattr(self, "memory", None), "residuals", None)
        return params_bytes if isinstance(residuals, dict) else 0

    def replica_ranks(self) -> list[int] | None:
        """The ranks holding this rank's parameters and optimizer state after every step, which
        share one checkpoint model file; None: every rank of the layout's group (hierarchical
        sync narrows it to the cluster)."""
        return None

    def checkpoint_period(self, every: int) -> int:
        """The checkpoint period to use when asked for one every ``every`` steps (hierarchical
        sync rounds it up to whole exchange cycles)."""
        return every

    def listeners(self) -> list:
        """Engine listeners the strategy needs (hierarchical sync exchanges parameters as layers finish)."""
        return []

    def step_metrics(self, step: int) -> dict:
        """Strategy-specific figures of ``step`` for the metrics file (none by default)."""
        return {}

    def _count(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_received += int(received)

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received so far."""
        with self._lock:
            return self.bytes_sent, self.bytes_received


class Done(PendingSync):
    """An exchange that needed no communication (a world of one)."""

    def __init__(self, result: torch.Tensor):
        self._result = result

    def is_done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self._result
