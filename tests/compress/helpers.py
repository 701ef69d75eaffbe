"""What the compression tests share: a one-layer bucket, a small MLP, and a few seeded training steps."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from convoy.engine import Engine
from convoy.engine.layers import Bucket, Layer


def one_layer_bucket(*shapes: tuple[int, ...]) -> Bucket:
    """A bucket of one layer with zero parameters of ``shapes`` and their gradients attached."""
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    out = Bucket(0, [Layer(0, "layer", nn.Module(), params)])
    out.attach_grads()
    return out


def small_mlp() -> nn.Module:
    """12 inputs, 32 hidden, 4 classes, initialised from seed 3."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))


def train_steps(model: nn.Module, engine_or_optimizer: Engine | torch.optim.Optimizer, steps: int,
                seed: int = 1) -> None:
    """``steps`` steps on random batches of 8 (from ``seed``), through an engine or a plain optimizer."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        loss = F.cross_entropy(model(x), y)
        if isinstance(engine_or_optimizer, Engine):
            engine_or_optimizer.backward(loss)
            engine_or_optimizer.synchronize()
        else:
            engine_or_optimizer.zero_grad()
            loss.backward()
            engine_or_optimizer.step()
