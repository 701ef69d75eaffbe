"""The sync-strategy interface: the exchange stage of the engine's step.

The engine's step, per bucket of layers, is a pipeline of stages::

    gradient ready -> compress (+ error feedback) -> exchange -> decompress
        -> update -> snapshot (listeners) -> the next forward's per-layer wait

A :class:`SyncStrategy` owns the middle three (its compressor and memory are
:mod:`convoy.compress` objects) and says where the update runs:

- locally (``returns_parameters = False``: all-reduce, hierarchical): the
  exchange yields the averaged gradient and the engine's bucket optimizer
  applies it on this rank;
- on a server (``returns_parameters = True``: a parameter-server worker): the
  exchange pushes the gradient and yields the updated parameters the server
  sent back; the engine copies them in. The server itself runs the same
  engine, whose exchange collects the workers' pushes and whose update stage
  runs the bucket optimizers on the shard it owns.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from convoy.compress import Place, Support

# ``replay(step, layer names)``: a bucket's averaged gradient of ``step`` as a checkpoint's log
# recorded it, or None for a step it does not replay (:meth:`SyncStrategy.start_replay`).
Replay = Callable[[int, "tuple[str, ...]"], "torch.Tensor | None"]


class Trace(Protocol):
    """Spans recorded for a Chrome trace (:class:`convoy.ps.timeline.Timeline` is one)."""

    def save(self, run_dir: Path) -> Any:
        """Write the trace into ``run_dir``."""


class PendingSync(ABC):
    """An exchange in flight for one layer.

    After :meth:`wait`, ``support`` may say where the averaged gradient can be non-zero
    (a :class:`convoy.compress.Support`; None: anywhere), and ``finite`` is True where the
    exchange has established from its payload that the average holds no NaN or infinity
    (:meth:`convoy.compress.Compressor.certainly_finite`), so the caller need not scan it.
    """

    support: Support | None = None
    finite: bool = False

    @abstractmethod
    def is_done(self) -> bool:
        """True once ``wait`` would not block."""

    @abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the exchange ends; return the averaged flat gradient."""

    def advance(self) -> None:
        """Start the rest of an exchange whose intermediate round was left in flight (PowerSGD's
        ``P``, see :meth:`SyncStrategy.start`); nothing for an exchange started whole.

        It issues collectives: call it at points every rank reaches in the same order (the
        engine: after starting the next bucket, and after the step's last).
        """

    def future(self) -> torch.futures.Future:
        """A torch Future of the averaged flat gradient (what a DDP comm hook returns).

        It waits first, on the calling thread: a callback chained on the collective's own
        future would run (and be destroyed) on gloo's worker thread, which can race the
        interpreter's exit and abort the process.
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
    # The exchange's result is the bucket's updated flat parameters (the update ran elsewhere).
    returns_parameters: bool = False
    # Exchanges may end in any order (point to point); collectives end in the order started.
    completes_in_order: bool = True
    # The spans the strategy records for a Chrome trace (``--trace``), which the layout saves;
    # None: it records none.
    timeline: Trace | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    @abstractmethod
    def start(self, bucket: Any, grad: torch.Tensor) -> PendingSync:
        """Begin exchanging ``grad``, the flat local gradient of ``bucket``'s layers.

        ``bucket`` is an engine bucket: ``index`` (the same on every rank),
        ``layers``, ``params``. An exchange of several rounds may return with
        its first round in flight; the engine calls its :meth:`PendingSync.advance`
        once the next bucket's exchange has started (or the step's last has).
        """

    def next_done(self, pending: Sequence[PendingSync]) -> int:
        """The position in ``pending`` (exchanges in the order started) of one that ends next.

        In-order strategies answer 0 (the engine then waits on it). Strategies
        whose exchanges end out of order block until any is done and name it,
        so a layer whose parameters came back early is applied at once.
        """
        return 0

    def close(self) -> None:
        """Release the strategy's transport (threads, streams); the engine calls it once, last."""

    def set_step(self, step: int) -> None:
        """The next exchange belongs to ``step`` (resuming); strategies with step-dependent behaviour override."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's exchange state that a bit-identical resume needs, by stable name (``kind.name``).

        Checkpoints keep it in the rank's own file and hand it back through
        :meth:`load_state_tensors`. Strategies with state (error-feedback
        residuals, a compressor's warm-start factors, a cluster plan, exchange
        counters as tensors) override it; the default is none.
        """
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`state_tensors` returned (copies owned by the strategy from now on)."""

    def state_bytes_bound(self, params_bytes: int) -> int:
        """At most how many bytes :meth:`state_tensors` will hold (a checkpoint reserves disk for it),
        for parameters of ``params_bytes``."""
        return 0

    def replaced_each_step(self) -> tuple[str, ...]:
        """The kinds (``kind`` of a ``kind.name`` key) of :meth:`state_tensors` whose tensors the
        strategy replaces by new ones every step, never writing into them: a reference to one is a
        snapshot, which a checkpoint need not copy. Empty by default (a checkpoint copies them all)."""
        return ()

    def place_state_in(self, place: Place | None) -> None:
        """Build the new tensors of the kinds :meth:`replaced_each_step` names where ``place`` says
        from now on (``None``: new tensors again); see :meth:`convoy.compress.Memory.place_in`.
        Strategies without such state ignore it.

        Example::

            >>> sync.place_state_in(lambda key, like: arena.place("sync." + key, like, step))
        """

    def start_replay(self, replay: Replay) -> None:
        """Take the averaged gradient of every exchange ``replay`` covers from it instead of the
        network (a resume replaying a checkpoint's logged steps), until :meth:`stop_replay`.

        Raises:
            NotImplementedError: the strategy cannot replay (only all-reduce, whose exchange state
                each rank rebuilds from its own gradients, can).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot replay logged steps")

    def stop_replay(self) -> None:
        """Exchange over the network again (a resume's replay is over)."""

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

    def explain_failure(self, exc: BaseException) -> BaseException:
        """The error to report for ``exc``, which ended this rank's training: ``exc`` itself, or
        what the strategy knows to be its cause (a parameter-server worker names the dead server
        where a collective elsewhere only saw a connection reset)."""
        return exc

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

    def __init__(self, result: torch.Tensor, support: Support | None = None):
        self._result, self.support = result, support

    def is_done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self._result
