"""What happens to a layer's gradient on its way to an exchange and back: one object per job.

Error feedback (the memory), the compressor, the warm-up (a density ramp, or
dense steps for a compressor without a density) and a resume's replay belong
together: every exchange runs them in the same order, and a checkpoint saves and
restores their state together. :class:`CompressionPipeline` holds them;
:class:`~convoy.sync.AllReduce` (and so hierarchical sync and the parameter
server's push), the server's row codec and :mod:`convoy.ddp`'s comm hooks compose
one instead of each wiring a memory and a compressor of its own.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from convoy.compress import Compressor, IdentityCompressor, Memory, NoMemory, Place
from convoy.compress.base import Payload
from convoy.core import Replay

# A warm-up's first step sends this share of every layer (DGC's 25%).
WARMUP_START_DENSITY = 0.25


class CompressionPipeline:
    """Error feedback, compression, warm-up and replay of one job's gradients.

    Args:
        compressor: how a layer's gradient is put on the wire (default: as it is).
        memory: error-feedback memory for what the compressor loses (default: none).
        warmup_steps: ramp a sparse compressor's density down over the first this
            many steps, exponentially from 25% to its own (DGC's warm-up); a
            compressor without a density (fp16, a fixed block count) sends them
            uncompressed instead.

    Example::

        >>> pipeline = CompressionPipeline(*build_compressor("topk", element_fraction=0.01), warmup_steps=20)
        >>> pipeline.warmup_density(0), pipeline.compressor_at(0).density
        (0.25, 0.01)
    """

    __slots__ = ("compressor", "memory", "warmup_steps", "_dense", "_replay")

    def __init__(self, compressor: Compressor | None = None, memory: Memory | None = None, warmup_steps: int = 0):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.compressor = compressor or IdentityCompressor()
        self.memory = memory or NoMemory()
        self.warmup_steps = warmup_steps
        self._dense = IdentityCompressor()
        # A resume that rebuilds error feedback by replaying logged steps: the averages of the
        # steps it covers come from the checkpoint's log, the others are exchanged.
        self._replay: Replay | None = None

    # 1. Warm-up: which compressor and density a step uses.
    def compressor_at(self, step: int) -> Compressor:
        """The compressor of ``step``: dense while a compressor without a density warms up."""
        if step < self.warmup_steps and self.compressor.density is None:
            return self._dense
        return self.compressor

    def warmup_density(self, step: int) -> float | None:
        """The least share of each layer sent at ``step``: 25% decaying exponentially to the
        compressor's density over the warm-up, then None (the compressor's own)."""
        target = self.compressor.density
        if step >= self.warmup_steps or target is None or target >= WARMUP_START_DENSITY:
            return None
        return WARMUP_START_DENSITY * (target / WARMUP_START_DENSITY) ** (step / self.warmup_steps)

    # 2. Error feedback before compressing, 3. and what was not sent after.
    @property
    def needs_params(self) -> bool:
        """Whether :meth:`compensate` reads the parameters (momentum correction adds weight decay)."""
        return self.memory.needs_params

    def compensate(self, grad: torch.Tensor, name: str,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """``grad`` plus what earlier steps did not send of layer ``name`` (and its velocity)."""
        return self.memory.compensate(grad, name, params)

    def keep_unsent(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                    ctx: Any) -> None:
        """Keep what ``payload`` (the final one) does not send of ``compensated`` for the next step."""
        self.memory.keep_unsent(compensated, name, compressor, payload, ctx)

    # 4. A resume's replay.
    def start_replay(self, replay: Replay) -> None:
        """Take the averages of the steps ``replay`` covers from it (:mod:`convoy.checkpoint.replay`)."""
        self._replay = replay

    def stop_replay(self) -> None:
        self._replay = None

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    def replayed(self, step: int, layers: tuple[str, ...] | None) -> torch.Tensor | None:
        """The logged average of ``layers`` at ``step`` during a replay; None: exchange it."""
        if self._replay is None or layers is None:
            return None
        return self._replay(step, layers)

    # State a checkpoint saves and restores.
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The memory's residuals (and velocities), and the compressor's warm start."""
        return {**self.memory.state_tensors(), **self.compressor.state_tensors()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.memory.load_state_tensors(tensors)
        self.compressor.load_state_tensors(tensors)

    def state_bytes_bound(self, params_bytes: int) -> int:
        """A parameter-sized tensor per kind the memory keeps, and the compressor's own."""
        return params_bytes * len(self.memory.kept()) + self.compressor.state_bytes_bound(params_bytes)

    def replaced_each_step(self) -> tuple[str, ...]:
        """The memory's (:attr:`convoy.compress.Memory.replaced_each_step`)."""
        return self.memory.replaced_each_step

    def place_state_in(self, place: Place | None) -> None:
        """The memory builds its new tensors there (:meth:`convoy.compress.Memory.place_in`)."""
        self.memory.place_in(place)

    def forget(self, name: str) -> None:
        """Drop layer ``name``'s residual and warm start (its parameters changed)."""
        self.memory.forget(name)
        self.compressor.forget(name)
