"""Optimizers by name, and the hyper-parameters each one accepts."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch

from convoy.errors import UsageError
from convoy.train.config import TrainConfig
from convoy.utils.imports import is_import_path, load_object

_BY_NAME: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class called ``name`` (a built-in name or package.module:Class)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    if is_import_path(name):
        try:
            cls = load_object(name)
        except ValueError as exc:
            raise UsageError(f"cannot load optimizer: {exc}") from None
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return cls
        raise UsageError(f"{name} is not a torch.optim.Optimizer subclass")
    raise UsageError(f"unknown optimizer {name!r}; choose one of: {', '.join(_BY_NAME)}, or package.module:Class")


def supported_kwargs(optimizer_class: type, **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that ``optimizer_class`` takes (Adam has no momentum)."""
    params = inspect.signature(optimizer_class.__init__).parameters
    return {k: v for k, v in candidates.items() if k in params}


def corrects_momentum(config: TrainConfig) -> bool:
    """Whether ``config`` trains with momentum correction: SGD with momentum and a sparse or low-rank compressor.

    The workers then keep the momentum (and weight decay) in their error-feedback
    memory, and the layer optimizers step without either.
    """
    from convoy.compress import MOMENTUM_CORRECTED_NAMES

    return (config.momentum_correction and config.compress in MOMENTUM_CORRECTED_NAMES
            and config.optimizer == "sgd" and config.momentum > 0)


def lr_lambda(schedule: str, total_steps: int) -> Callable[[int], float] | None:
    """``step -> factor`` for the named schedule; ``None`` for a constant rate."""
    if schedule == "constant":
        return None
    if schedule == "cosine":
        return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))
    raise UsageError(f"unknown learning-rate schedule {schedule!r}")
