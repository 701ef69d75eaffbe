"""Momentum correction: error feedback on the velocity, so momentum and sparsity do not compound.

With plain error feedback the unsent gradient waits in a residual and leaves
in a burst when its block is finally chosen; momentum SGD applied to the
averaged sparse gradient then repeats that burst for ``1 / (1 - m)`` steps.
Both mechanisms integrate the same signal, and together they overshoot: this
is what made block-sparse training collapse once dense warm-up ended (the
layer optimizers' momentum buffers, filled by dense steps, kept pushing while
residuals piled up behind the 1% of blocks sent).

Here each worker keeps the momentum itself: ``u = m u + g`` (the velocity) and
``v = v + u`` (what it owes), compresses ``v``, and the exchanged average is
applied as a plain SGD step, without the optimizer's own momentum. Where a
value that had waited was sent, both ``u`` and ``v`` are zeroed (momentum
factor masking), so a stale velocity does not keep pushing a coordinate that
was just updated; values sent every step keep their velocity, so sending
everything is exactly momentum SGD.
The local gradient is clipped before it enters ``u``.

Masking is for sparse compressors, which send some values whole and others
not at all. A low-rank compressor (PowerSGD) sends a part of every value, so
there is nothing to mask: ``masking=False`` keeps the velocity, and what is
sent over the steps still adds up exactly to the velocities accumulated.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from convoy.compress.base import Compressor, Memory, Payload


class MomentumCorrection(Memory):
    """Error feedback on a locally accumulated velocity (use with a momentum-free optimizer step).

    Invariant, per call: ``sent + new residual == old residual + u`` exactly,
    with ``u = m * u_masked + clipped gradient`` (the residual is that sum minus
    what was sent, and a sparse compressor sends exact copies of it).

    Args:
        momentum: ``m``, the optimizer's momentum, which this memory takes over.
        clip_norm: clip each parameter's local gradient to this L2 norm divided by
            ``sqrt(world_size)`` (so the average obeys ``clip_norm``); None: no clipping.
        world_size: workers averaging the gradient.
        weight_decay: added to the gradient (``g + wd * w``) before it enters
            the velocity, as momentum SGD would; the optimizer's own is then 0.
        masking: zero the velocity where a value that had waited was sent
            (sparse compressors); False for compressors that send a part of
            every value (PowerSGD).

    Example::

        >>> memory = MomentumCorrection(0.9)
        >>> compensated = memory.compensate(grad, "3")
        >>> sent = compressor.decompress(*compressor.compress(compensated, "3"))
        >>> memory.update(compensated, "3", sent)
    """

    # Both are new tensors every step (written into buffers no snapshot holds, Memory.new_tensor):
    # a checkpoint keeps a reference instead of copying them.
    replaced_each_step = ("residual", "velocity")

    def __init__(self, momentum: float, clip_norm: float | None = None, world_size: int = 1,
                 weight_decay: float = 0.0, masking: bool = True):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        super().__init__()
        self.momentum, self.weight_decay, self.masking = momentum, weight_decay, masking
        # The parameters mark where each one's gradient lies in a bucket's flat gradient: clipping is per
        # parameter, so a step's numerics do not depend on how the engine groups layers into buckets.
        self.needs_params = weight_decay != 0.0 or clip_norm is not None
        self.local_clip = None if clip_norm is None else clip_norm / math.sqrt(world_size)
        self.velocities: dict[str, torch.Tensor] = {}
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, tensor: torch.Tensor, name: str,
                   params: torch.Tensor | Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        # Every tensor here is one the memory reuses (no fresh gradient-sized allocation, whose page
        # faults cost as much as a pass), and the arithmetic is momentum SGD's own, rounding for
        # rounding: ``u = (m * u) + (clip * g + wd * w)``. The clipped, decayed gradient is built in
        # the compensated buffer, which is then overwritten with ``residual + u``; ``tensor`` is only read.
        compensated = self.compensated_buffer(name, tensor)
        gradient = self._decayed(self._clipped(tensor, params, compensated), params, compensated)
        previous = self.velocities.get(name)
        velocity = self.new_tensor(f"velocity.{name}", tensor)
        if previous is None:
            velocity.copy_(gradient)
        else:
            torch.mul(previous, self.momentum, out=velocity).add_(gradient)
        self.replace("velocity", name, velocity)
        residual = self.residuals.get(name)
        return compensated.copy_(velocity) if residual is None else torch.add(residual, velocity, out=compensated)

    def update(self, compensated: torch.Tensor, name: str, sent: torch.Tensor) -> None:
        delayed = self.residuals.get(name)
        if self.masking and delayed is not None:
            # Mask only values that waited: a value sent every step carries no
            # stale momentum, and keeping its velocity makes density 1.0 exactly
            # momentum SGD.
            self.velocities[name].masked_fill_((sent != 0) & (delayed != 0), 0.0)
        self.replace("residual", name, self.new_residual(compensated, name, sent))

    def keep_unsent(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                    ctx: Any) -> None:
        if self.masking:   # the mask needs what was sent, value by value
            super().keep_unsent(compensated, name, compressor, payload, ctx)
        else:
            self.replace("residual", name, self.unsent_residual(compensated, name, compressor, payload, ctx))

    def forget(self, name: str) -> None:
        self.residuals.pop(name, None)
        self.velocities.pop(name, None)
        self._spares.forget(name)

    def kept(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"residual": self.residuals, "velocity": self.velocities}

    def _decayed(self, gradient: torch.Tensor, params: torch.Tensor | Sequence[torch.Tensor] | None,
                 out: torch.Tensor) -> torch.Tensor:
        """``gradient + weight_decay * params`` written into ``out`` (``gradient`` may be ``out``), as
        torch's SGD adds it; ``gradient`` itself without weight decay. Parameters given one by one are
        read in place, each into its range of ``out`` (the same element-wise sums)."""
        if not self.weight_decay or params is None:
            return gradient
        if isinstance(params, torch.Tensor):
            return torch.add(gradient, params.reshape(gradient.shape), alpha=self.weight_decay, out=out)
        total = sum(p.numel() for p in params)
        if total != gradient.numel():
            raise ValueError(f"the parameters hold {total} values, the gradient {gradient.numel()}")
        flat, into, offset = gradient.reshape(-1), out.view(-1), 0
        for p in params:
            end = offset + p.numel()
            torch.add(flat[offset:end], p.reshape(-1), alpha=self.weight_decay, out=into[offset:end])
            offset = end
        return out

    def _clipped(self, tensor: torch.Tensor, params: torch.Tensor | Sequence[torch.Tensor] | None,
                 out: torch.Tensor) -> torch.Tensor:
        """``tensor`` with each parameter's gradient clipped to the local norm: scaled into ``out``
        where one is longer (the rest copied), else ``tensor`` itself. Parameters given one by one
        mark where each gradient lies; flat or absent, ``tensor`` is one gradient."""
        if self.local_clip is None:
            return tensor
        flat = tensor.reshape(-1)
        sizes = [flat.numel()] if params is None or isinstance(params, torch.Tensor) else [p.numel() for p in params]
        pieces = flat.split(sizes)
        norms = torch.stack([torch.linalg.vector_norm(piece) for piece in pieces]).tolist()
        if all(norm <= self.local_clip for norm in norms):
            return tensor
        for piece, into, norm in zip(pieces, out.view(-1).split(sizes), norms):
            if norm > self.local_clip:
                torch.mul(piece, self.local_clip / norm, out=into)
            else:
                into.copy_(piece)
        return out
