"""What happens to the averaged gradient between its exchange and the update.

By default every bucket is checked on its own (a non-finite averaged gradient
stops the run before it reaches the parameters) and updated as soon as its
exchange ends. A :class:`GradientGate` with clipping or fp16 loss scaling needs
the whole step's gradient first (a global norm, one skip decision for all
layers), so the engine defers that step's updates until every exchange ended.

When a step's gradient is spread over ranks (parameter servers that each own a
shard, the two groups of a hybrid job), the gate's ``group`` sums every rank's
share of the squared norm, so each rank clips by, and skips on, the norm of the
whole averaged gradient. A rank whose update runs elsewhere (a parameter-server
worker) only ``follow``s: it adds nothing and keeps its loss scale in step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from convoy.errors import TrainingDiverged


def is_finite(grad: torch.Tensor) -> bool:
    """True when every element of ``grad`` is finite; one pass (a sum) instead of an elementwise mask."""
    return bool(torch.isfinite(grad.sum()))


def check_finite(grad: torch.Tensor, step: int, where: str) -> None:
    """Raise :class:`TrainingDiverged` when ``grad`` holds a NaN or an infinity."""
    if not is_finite(grad):
        raise TrainingDiverged(step, f"the averaged gradient of {where} became non-finite")


class LossScaler:
    """Dynamic loss scaling for fp16 autocast, the rule of ``torch.amp.GradScaler``.

    The loss is multiplied by ``scale`` before backward, so small fp16 gradients
    do not flush to zero; the engine divides the averaged gradient by it before
    the update. A step whose gradient overflowed is skipped and the scale halved;
    after ``growth_interval`` good steps in a row it doubles.

    Args:
        init_scale: the first scale.
        growth_interval: good steps between doublings.
        min_scale: below this the gradient overflows at any scale: the run diverged.

    Example::

        >>> scaler = LossScaler()
        >>> engine = Engine(model, torch.optim.SGD, sync, gate=GradientGate(scaler=scaler), lr=0.05)
        >>> engine.backward(scaler.scale_loss(loss))
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000, min_scale: float = 2.0 ** -16):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.skipped_steps = 0
        self._good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The scale and its counters, as tensors a checkpoint keeps (a resumed run scales as this one would)."""
        return {"scale": torch.tensor(self.scale, dtype=torch.float64),
                "good_steps": torch.tensor(self._good_steps, dtype=torch.int64),
                "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what :meth:`state_tensors` gave; keys it lacks leave their value as it is."""
        if "scale" in tensors:
            self.scale = float(tensors["scale"])
        if "good_steps" in tensors:
            self._good_steps = int(tensors["good_steps"])
        if "skipped_steps" in tensors:
            self.skipped_steps = int(tensors["skipped_steps"])

    def update(self, overflowed: bool, step: int) -> None:
        """Adjust the scale after ``step``; raise :class:`TrainingDiverged` if it collapsed."""
        if overflowed:
            self.scale /= 2.0
            self._good_steps = 0
            self.skipped_steps += 1
            if self.scale < self.min_scale:
                raise TrainingDiverged(step, f"the fp16 gradient overflowed at every loss scale down to "
                                             f"{self.min_scale:g}")
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0


KEPT_STEPS = 64   # how many steps' figures a gate keeps for the metrics


@dataclass
class GradientGate:
    """Whole-step processing of the averaged gradient: fp16 unscaling and global-norm clipping.

    Args:
        clip_grad_norm: the largest global L2 norm of the averaged gradient, over
            every layer of the engine; larger gradients are scaled down to it
            (``torch.nn.utils.clip_grad_norm_``'s rule). ``None``: no clipping.
        scaler: the fp16 loss scaler whose scale the gradient carries, if any.
        group: the process group over which the step's whole gradient is spread
            (every rank of it calls :meth:`process` or :meth:`follow` once a step,
            in step order); ``None``: this engine holds all of it.
        share: the weight of this rank's squared norm in the group's sum: 1 where
            each rank holds its own layers (parameter servers), 1 / its replicas
            where a group of ranks holds the same averaged gradient (hybrid).

    Example::

        >>> engine = Engine(model, torch.optim.SGD, sync, gate=GradientGate(clip_grad_norm=1.0), lr=0.05)
    """

    clip_grad_norm: float | None = None
    scaler: LossScaler | None = None
    group: Any = None
    share: float = 1.0
    last_norm: float = float("nan")   # the global norm of the latest step, before clipping
    # Each recent step's figures, until the metrics writer takes them (the gate runs ahead of it).
    _figures: dict[int, dict[str, float]] = field(default_factory=dict, repr=False)

    @property
    def needs_whole_step(self) -> bool:
        return self.clip_grad_norm is not None or self.scaler is not None

    def process(self, grads: list[torch.Tensor], step: int) -> bool:
        """Unscale and clip ``grads`` (every bucket's flat averaged gradient) in place.

        Returns whether the step's update should be applied (False: an fp16
        overflow, the step is skipped). Raises :class:`TrainingDiverged` for a
        non-finite gradient without fp16 scaling.
        """
        if self.scaler is not None:
            for grad in grads:
                grad.div_(self.scaler.scale)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64)
                                                     for g in grads]))
        if not self._decide(norm, step):
            return False
        if self.clip_grad_norm is not None and self.last_norm > self.clip_grad_norm:
            factor = self.clip_grad_norm / (self.last_norm + 1e-6)
            for grad in grads:
                grad.mul_(factor)
        return True

    def step_metrics(self, step: int) -> dict[str, float]:
        """``step``'s global gradient norm (before clipping) and, with fp16, the loss scale it ran with."""
        return self._figures.pop(step, {})

    def _keep_figures(self, step: int, figures: dict[str, float]) -> None:
        self._figures[step] = figures
        self._figures.pop(step - KEPT_STEPS, None)   # no one is reading them (an engine used without the loop)

    def follow(self, step: int) -> None:
        """Take part in ``step``'s decision without a gradient of one's own (the update runs elsewhere).

        Keeps this rank's loss scale equal to the updating ranks', and raises
        :class:`TrainingDiverged` at the step they do.
        """
        self._decide(torch.zeros((), dtype=torch.float64), step)

    def _decide(self, local_norm: torch.Tensor, step: int) -> bool:
        """The step's global norm from this rank's; update the scale; False: skip the step."""
        norm = local_norm
        if self.group is not None:
            # On the CPU on every rank: a rank that only follows has no gradient, hence no device.
            squared = (local_norm.square() * self.share).reshape(1).cpu()
            dist.all_reduce(squared, group=self.group)   # a non-finite share makes every rank's sum non-finite
            norm = squared[0].sqrt()
        self.last_norm = float(norm)
        self._keep_figures(step, {"grad_norm": self.last_norm,
                                  **({"loss_scale": self.scaler.scale} if self.scaler is not None else {})})
        finite = bool(torch.isfinite(norm))
        if self.scaler is not None:
            self.scaler.update(not finite, step)
        elif not finite:
            raise TrainingDiverged(step, "the averaged gradient became non-finite")
        return finite
