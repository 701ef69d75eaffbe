"""Stopping a run whose loss became NaN or infinite, on every rank at the same step."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from convoy.errors import TrainingDiverged


def divergence_hint(lr: float, amp: str, clip_grad_norm: float | None, can_clip: bool = True) -> str:
    """What to try after a run diverged, given its settings (``can_clip``: the layout supports clipping)."""
    tries = [f"a lower --lr (this run: {lr:g})"]
    if clip_grad_norm is None and can_clip:
        tries.append("--clip-grad-norm 1.0")
    if amp != "off":
        tries.append("--amp off")
    return "try " + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1]


class DivergenceGuard:
    """Checks each step's local loss; a non-finite loss on any rank stops every rank.

    Each step all-reduces one flag (MAX) on a process group of its own, without
    waiting for it: the flag of step s is read at step s + 1, so the check costs
    a 4-byte collective in the background, not a pause. Every rank raises
    :class:`TrainingDiverged` at the same step, whichever rank saw the NaN.

    Args:
        group: the process group of all ranks (None: a world of one).
        hint: what to try, appended to the message.

    Example::

        >>> guard = DivergenceGuard(dist.new_group(), hint="try a lower --lr")
        >>> for step, batch in enumerate(batches):
        ...     guard.check(step, layout.train_step(*batch)[0])
        >>> guard.finish()
    """

    def __init__(self, group: dist.ProcessGroup | None, hint: str):
        self._group = group
        self._hint = hint
        self._pending: tuple[int, torch.Tensor, dist.Work | None, float] | None = None
        self._last_loss: tuple[int, float] | None = None   # this rank's latest (step, loss)

    def check(self, step: int, loss: float) -> None:
        """Raise if an earlier step's loss was non-finite anywhere; start agreeing on ``step``'s."""
        self.finish()
        self._last_loss = (step, loss)
        flag = torch.tensor([0.0 if math.isfinite(loss) else 1.0])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True) \
            if self._group is not None else None
        self._pending = (step, flag, work, loss)

    def finish(self) -> None:
        """Wait for the last step's agreement; raise :class:`TrainingDiverged` if it failed."""
        if self._pending is None:
            return
        step, flag, work, loss = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if flag.item() > 0:
            where = f"({loss})" if not math.isfinite(loss) else "on another rank"
            raise TrainingDiverged(step, f"training diverged: the loss became non-finite {where}", self._hint)

    def explain(self, exc: TrainingDiverged) -> TrainingDiverged:
        """``exc`` (e.g. the engine's non-finite gradient) with the latest loss and what to try."""
        if exc.what.startswith("training diverged"):
            return TrainingDiverged(exc.step, exc.what, self._hint)
        hint = self._hint
        if self._last_loss is not None:
            step, loss = self._last_loss
            hint = f"this rank's loss at step {step}: {loss:.3g}; {hint}"
        return TrainingDiverged(exc.step, f"training diverged: {exc.what}", hint)
