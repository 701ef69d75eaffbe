"""The parameter-server layout of a training job (``--sync ps``), from a TrainConfig."""
from __future__ import annotations

import torch
from torch import nn

from convoy import runtime
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps.settings import PSSettings
from convoy.train.config import TrainConfig
from convoy.train.optim import build_compression, lr_lambda, optimizer_spec


def ps_settings(config: TrainConfig) -> PSSettings:
    return PSSettings.resolve(config.servers or 1, config.priority, config.channels, config.slice_kb,
                              config.credit_kb, config.trace_steps if config.trace else 0)


def example_batch(config: TrainConfig, input_shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Random inputs like a training batch (traced for the priorities), from a private generator:
    the global seed stays as it was."""
    return torch.randn(config.batch_size, *input_shape, generator=torch.Generator().manual_seed(0)).to(device)


def build_ps_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int,
                    input_shape: tuple[int, ...]) -> ParameterServerLayout:
    """This rank's server or worker, with the settings of ``config``."""
    settings = ps_settings(config)
    optimizer_class, hyper = optimizer_spec(config)
    compressor, memory = build_compression(config, ctx.world_size - settings.servers)
    return ParameterServerLayout(model, settings, ctx.rank, ctx.world_size, optimizer_class, hyper,
                                 example_batch(config, input_shape, ctx.device),
                                 lr_lambda(config.lr_schedule, total_steps), compressor=compressor, memory=memory,
                                 warmup_steps=config.warmup())
