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
    """Whether ``config`` trains with momentum correction: SGD with momentum and a sparse, low-rank or fp16
    compressor (``convoy.compress.momentum_corrected_names()``).

    The workers then keep the momentum (and weight decay) in their error-feedback
    memory, and the layer optimizers step without either.
    """
    from convoy.compress import momentum_corrected_names

    return (config.compress.momentum_correction and config.compress.name in momentum_corrected_names()
            and config.optim.name == "sgd" and config.optim.momentum > 0)


def lr_lambda(schedule: str, total_steps: int) -> Callable[[int], float] | None:
    """``step -> factor`` for the named schedule; ``None`` for a constant rate."""
    if schedule == "constant":
        return None
    if schedule == "cosine":
        return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))
    raise UsageError(f"unknown learning-rate schedule {schedule!r}")


def optimizer_spec(config: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and the hyper-parameters of it that ``config`` sets."""
    optimizer_class = resolve_optimizer(config.optim.name)
    if corrects_momentum(config):   # the workers' error-feedback memory applies both
        return optimizer_class, {"lr": config.optim.lr, "momentum": 0.0, "weight_decay": 0.0}
    return optimizer_class, supported_kwargs(optimizer_class, lr=config.optim.lr, momentum=config.optim.momentum,
                                             weight_decay=config.optim.weight_decay)


def build_compression(config: TrainConfig, workers: int) -> tuple[Any, Any]:
    """The compressor and error-feedback memory of ``config`` for an exchange among ``workers`` ranks.

    The same objects serve every strategy: all-reduce and hierarchical exchange
    their payloads, a parameter-server worker pushes them.
    """
    from convoy.compress import MomentumCorrection, build_compressor, compressor_spec

    compress = config.compress
    compressor, memory = build_compressor(
        compress.name, blocks_per_layer=compress.blocks_per_layer, block_fraction=compress.block_fraction,
        block_metric=compress.block_metric, block_selection=compress.block_selection,
        block_size=compress.block_size, element_fraction=compress.element_fraction,
        powersgd_rank=compress.powersgd_rank, dense_below=compress.dense_below)
    if corrects_momentum(config):
        # Masking zeroes the momentum of values sent whole; a low-rank payload sends part of every value.
        memory = MomentumCorrection(config.optim.momentum, compress.clip_norm, workers, config.optim.weight_decay,
                                    masking=compress.momentum_masking and compressor_spec(compress.name).sparse)
    return compressor, memory


def needs_whole_step(config: TrainConfig, world_size: int) -> bool:
    """Whether a step's whole gradient is spread over several ranks' engines for clipping and fp16 loss
    scaling: under ``--sync ps`` (each server holds a shard; the workers follow the servers' decision)
    and ``--parallel hybrid`` (the conv group holds one part, the FC group the other). Its group,
    every rank, is :attr:`convoy.parallel.groups.ProcessGroups.whole_step`."""
    needed = config.optim.clip_grad_norm is not None or config.optim.amp == "fp16"
    return needed and world_size > 1 and (config.strategy_spec().spreads_step or config.layout_spec().spreads_step)
