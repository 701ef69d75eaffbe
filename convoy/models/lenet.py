"""LeNet-5 style network: two conv/pool stages and three fully-connected layers."""
from __future__ import annotations

from torch import nn

from convoy.models.base import FeatureClassifier, flat_size


def lenet(
    in_channels: int = 1, num_classes: int = 10, image_size: tuple[int, int] = (32, 32)
) -> FeatureClassifier:
    """Build LeNet-5; padding on the first conv lets 28x28 and 32x32 inputs both fit."""
    features = nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    classifier = nn.Sequential(
        nn.Flatten(),
        nn.Linear(flat_size(features, in_channels, image_size), 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )
    return FeatureClassifier(features, classifier)
