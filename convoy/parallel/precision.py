"""How a layout runs a step's forward and backward: micro-batches, autocast and fp16 loss scaling.

Every layout shares these rules, so a data-parallel, parameter-server or hybrid
step of N micro-batches equals one step on the N-times larger batch:

1. the step's samples are split in order into N equal micro-batches;
2. forward (and the loss) run under ``torch.autocast`` in bf16 or fp16, if asked;
3. each micro-batch's mean loss is divided by N and, under fp16, multiplied by
   the loss scale (the engine's gate divides the averaged gradient by it);
4. micro-batches 1..N-1 back-propagate with ``Engine.accumulate`` (nothing is
   exchanged), the last with ``Engine.backward``, which hands the summed
   gradient to the exchange.
"""
from __future__ import annotations

import contextlib

import torch

from convoy.engine import Engine
from convoy.engine.gradients import LossScaler

AMP_DTYPES = {None: None, "off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def split_sizes(samples: int, parts: int) -> list[int]:
    """The sizes ``Tensor.tensor_split(parts)`` gives a first dimension of ``samples``."""
    small, larger = divmod(samples, parts)
    return [small + 1] * larger + [small] * (parts - larger)


class Precision:
    """A step's micro-batches, autocast type and loss scale.

    Args:
        grad_accum: N, micro-batches per step.
        amp: ``"bf16"`` or ``"fp16"`` autocast; ``None`` or ``"off"``: float32.
        scaler: the fp16 loss scaler (the same object the engine's gate unscales with).

    Example::

        >>> precision = Precision(grad_accum=2, amp="bf16")
        >>> for last, (x_part, y_part) in precision.micro_batches(x, y):
        ...     with precision.autocast(x_part.device):
        ...         loss = F.cross_entropy(model(x_part), y_part)
        ...     precision.hand_over(engine, precision.scale(loss), last)
    """

    __slots__ = ("grad_accum", "amp_dtype", "scaler")

    def __init__(self, grad_accum: int = 1, amp: str | None = None, scaler: LossScaler | None = None):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        if amp not in AMP_DTYPES:
            raise ValueError(f"amp must be one of bf16, fp16, off, got {amp!r}")
        self.grad_accum = grad_accum
        self.amp_dtype = AMP_DTYPES[amp]
        self.scaler = scaler

    def micro_batches(self, *tensors: torch.Tensor) -> list[tuple[bool, tuple[torch.Tensor, ...]]]:
        """``(last, pieces)`` per micro-batch: each tensor split in order along its first dimension."""
        split = list(zip(*(t.tensor_split(self.grad_accum) for t in tensors)))
        return [(i == len(split) - 1, pieces) for i, pieces in enumerate(split)]

    def sizes(self, samples: int) -> list[int]:
        """The micro-batch sizes of a step of ``samples`` (those of ``micro_batches``)."""
        return split_sizes(samples, self.grad_accum)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.amp_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss as back-propagated: divided by N, times the fp16 loss scale."""
        scaled = loss / self.grad_accum if self.grad_accum > 1 else loss
        return self.scaler.scale_loss(scaled) if self.scaler is not None else scaled

    @staticmethod
    def hand_over(engine: Engine, output: torch.Tensor, last: bool, grad: torch.Tensor | None = None) -> None:
        """Back-propagate ``output``: accumulate, or (the step's last micro-batch) hand the step to the exchange."""
        if last:
            engine.backward(output, grad)
        else:
            engine.accumulate(output, grad)

    def train_step(self, model: torch.nn.Module, engine: Engine, loss_fn, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[float, int]:
        """One step of ``model`` on ``(x, y)``: (the mean of the micro-batches' losses, correct predictions)."""
        model.train()
        total_loss, correct = 0.0, 0
        for last, (x_part, y_part) in self.micro_batches(x, y):
            with self.autocast(x_part.device):
                logits = model(x_part)
                loss = loss_fn(logits, y_part)
            self.hand_over(engine, self.scale(loss), last)
            total_loss += loss.item()
            correct += int((logits.argmax(1) == y_part).sum())
        return total_loss / self.grad_accum, correct
