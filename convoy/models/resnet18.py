"""ResNet-18 in its CIFAR form: 3x3 stride-1 stem and no max-pool, for small images."""
from __future__ import annotations

import torch
from torch import nn

from convoy.models.base import FeatureClassifier

_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of first block)
_BLOCKS_PER_STAGE = 2


def _conv_bn(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Sequential:
    # The conv has no bias because the batch norm right after it has one.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 conv+BN) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(in_channels, out_channels, 3, stride)
        self.conv2 = _conv_bn(out_channels, out_channels, 3, 1)
        changes_shape = stride != 1 or in_channels != out_channels
        self.shortcut: nn.Module = (
            _conv_bn(in_channels, out_channels, 1, stride) if changes_shape else nn.Identity()
        )
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.conv1(x))
        return self.relu(self.conv2(out) + self.shortcut(x))


def resnet18(in_channels: int = 3, num_classes: int = 10) -> FeatureClassifier:
    """Build CIFAR ResNet-18; about 11.2M parameters for 3 input channels.

    Any image size works: the adaptive average pool reduces to 1x1.
    """
    layers: list[nn.Module] = [*_conv_bn(in_channels, 64, 3, 1), nn.ReLU()]
    width = 64
    for channels, stride in _STAGES:
        for i in range(_BLOCKS_PER_STAGE):
            layers.append(BasicBlock(width, channels, stride if i == 0 else 1))
            width = channels
    layers.append(nn.AdaptiveAvgPool2d(1))
    classifier = nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes))
    return FeatureClassifier(nn.Sequential(*layers), classifier)
