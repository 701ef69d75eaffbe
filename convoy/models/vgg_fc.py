"""VGG-style network whose parameters sit mostly in the fully-connected head.

This is the case hybrid training targets: cheap-to-sync convolutions, a large
classifier. No batch norm and no dropout, so runs are bit-reproducible and the
forward pass draws no random numbers.
"""
from __future__ import annotations

from torch import nn

from convoy.models.base import FeatureClassifier, flat_size

_STAGE_WIDTHS = (32, 64, 128)
_HIDDEN = 1024


def _stage(in_channels: int, out_channels: int) -> list[nn.Module]:
    """Two 3x3 convolutions then a 2x2 max-pool, halving the spatial size."""
    return [
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    ]


def vgg_fc(
    in_channels: int = 1, num_classes: int = 10, image_size: tuple[int, int] = (32, 32)
) -> FeatureClassifier:
    """Build the network; about 3.45M parameters for 1x32x32 input, >90% in the head."""
    layers: list[nn.Module] = []
    width = in_channels
    for out in _STAGE_WIDTHS:
        layers += _stage(width, out)
        width = out
    features = nn.Sequential(*layers)
    classifier = nn.Sequential(
        nn.Flatten(),
        nn.Linear(flat_size(features, in_channels, image_size), _HIDDEN),
        nn.ReLU(),
        nn.Linear(_HIDDEN, _HIDDEN),
        nn.ReLU(),
        nn.Linear(_HIDDEN, num_classes),
    )
    model = FeatureClassifier(features, classifier)
    _init_for_relu(model)
    return model


def _init_for_relu(model: nn.Module) -> None:
    # PyTorch's default init (uniform, a=sqrt(5)) shrinks the signal through
    # six ReLU convolutions without batch norm until SGD cannot start. This is
    # torchvision's VGG scheme: He init for convolutions, small normal weights
    # for the fully-connected layers, zero biases.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.01)
            nn.init.zeros_(module.bias)
