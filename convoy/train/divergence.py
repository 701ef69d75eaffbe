"""Stopping a run on every rank at the same step: when its loss became NaN or infinite, or when a
rank received a stop signal (SIGTERM, SIGINT, SIGHUP)."""
from __future__ import annotations

import math
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from convoy.errors import TrainingDiverged
from convoy.utils.collective import AsyncCollective


def divergence_hint(lr: float, amp: str, clip_grad_norm: float | None) -> str:
    """What to try after a run diverged, given its settings."""
    tries = [f"a lower --lr (this run: {lr:g})"]
    if clip_grad_norm is None:
        tries.append("--clip-grad-norm 1.0")
    if amp != "off":
        tries.append("--amp off")
    return "try " + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1]


@dataclass(frozen=True)
class StopAgreement:
    """What every rank learnt at the same step: a stop signal reached ranks ``first_rank``..``last_rank``."""

    signum: int
    first_rank: int
    last_rank: int

    def who(self) -> str:
        """``SIGTERM to rank 1``, or ``SIGTERM to ranks 0-3`` when several received one (torchrun's agent)."""
        name = signal.Signals(self.signum).name
        if self.first_rank == self.last_rank:
            return f"{name} to rank {self.first_rank}"
        return f"{name} to ranks {self.first_rank}-{self.last_rank}"


class DivergenceGuard:
    """Checks each step's local loss and stop signal; a non-finite loss or a signal on any rank
    stops every rank after the same step.

    Each step all-reduces four numbers (MAX) on a process group of its own,
    without waiting for them: the flags of step s are read at step s + 1, so
    the check costs a 32-byte collective in the background, not a pause.
    Every rank raises :class:`TrainingDiverged` at the same step, whichever
    rank saw the NaN, and every rank gets the same :class:`StopAgreement`,
    whichever rank received the signal.

    Args:
        group: the process group of all ranks, the job's ``ProcessGroups.bookkeeping`` (None: a world of one).
        hint: what to try, appended to the message.

    Example::

        >>> guard = DivergenceGuard(groups.bookkeeping, hint="try a lower --lr")
        >>> for step, batch in enumerate(batches):
        ...     if guard.check(step, layout.train_step(*batch)[0], stop=request.signum):
        ...         break   # every rank breaks here, after the same step
        >>> guard.finish()
    """

    def __init__(self, group: dist.ProcessGroup | None, hint: str):
        self._group = group
        self._rank = dist.get_rank() if group is not None else 0
        self._hint = hint
        self._pending: tuple[int, torch.Tensor, AsyncCollective | None, float] | None = None
        self._last_loss: tuple[int, float] | None = None   # this rank's latest (step, loss)

    def check(self, step: int, loss: float, stop: int = 0) -> StopAgreement | None:
        """Raise if an earlier step's loss was non-finite anywhere; start agreeing on ``step``'s.

        Args:
            step: the step just trained.
            loss: this rank's loss of it.
            stop: the stop signal this rank received (0: none).

        Returns:
            The stop signal some rank had received by the previous step, the same on
            every rank (None: go on).
        """
        agreed = self.finish()
        self._last_loss = (step, loss)
        # [non-finite loss, signal, -(first rank signalled), last rank signalled]: MAX of each.
        first, last = (-float(self._rank), float(self._rank)) if stop else (-math.inf, -math.inf)
        flag = torch.tensor([0.0 if math.isfinite(loss) else 1.0, float(stop), first, last], dtype=torch.float64)
        group = self._group
        work = AsyncCollective(flag, lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)) \
            if group is not None else None
        self._pending = (step, flag, work, loss)
        return agreed

    def finish(self) -> StopAgreement | None:
        """Wait for the last step's agreement; raise :class:`TrainingDiverged` if it failed."""
        if self._pending is None:
            return None
        step, flag, work, loss = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        nonfinite, signum, first, last = flag.tolist()
        if nonfinite > 0:
            where = f"({loss})" if not math.isfinite(loss) else "on another rank"
            raise TrainingDiverged(step, f"training diverged: the loss became non-finite {where}", self._hint)
        return StopAgreement(int(signum), int(-first), int(last)) if signum else None

    def explain(self, exc: TrainingDiverged) -> TrainingDiverged:
        """``exc`` (e.g. the engine's non-finite gradient) with the latest loss and what to try."""
        if exc.what.startswith("training diverged"):
            return TrainingDiverged(exc.step, exc.what, self._hint)
        hint = self._hint
        if self._last_loss is not None:
            step, loss = self._last_loss
            hint = f"this rank's loss at step {step}: {loss:.3g}; {hint}"
        return TrainingDiverged(exc.step, f"training diverged: {exc.what}", hint)
