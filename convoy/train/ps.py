"""The parameter-server layout of a training job (``--sync ps``)."""
from __future__ import annotations

import torch
from torch import nn

from convoy import runtime
from convoy.parallel.ps import ParameterServerLayout
from convoy.ps.settings import PSSettings
from convoy.train.config import TrainConfig
from convoy.train.optim import lr_lambda


def build_ps_layout(config: TrainConfig, model: nn.Module, ctx: runtime.Context, total_steps: int,
                    input_shape: tuple[int, ...]) -> ParameterServerLayout:
    """This rank's server or worker, with the settings of ``config``."""
    from convoy.train.loop import optimizer_spec

    settings = PSSettings.resolve(config.servers or 1, config.priority, config.channels, config.slice_kb,
                                  config.credit_kb, config.trace_steps if config.trace else 0)
    optimizer_class, hyper = optimizer_spec(config)
    # Random inputs from a private generator: the global seed stays as it was.
    example = torch.randn(config.batch_size, *input_shape, generator=torch.Generator().manual_seed(0))
    return ParameterServerLayout(model, settings, ctx.rank, ctx.world_size, optimizer_class, hyper,
                                 example.to(ctx.device), lr_lambda(config.lr_schedule, total_steps))
