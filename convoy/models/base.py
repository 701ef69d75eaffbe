"""The shape every built-in model shares: a feature extractor followed by a head.

Hybrid training replicates the two halves differently, so the boundary must be
an attribute rather than something inferred from ``forward``.
"""
from __future__ import annotations

import torch
from torch import nn

from convoy.errors import UsageError


class FeatureClassifier(nn.Module):
    """``forward(x) = classifier(features(x))``.

    ``classifier`` is expected to start with ``nn.Flatten`` so that the tensor
    crossing the boundary is the last convolutional activation, unflattened.
    """

    def __init__(self, features: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.features = features
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def flat_size(features: nn.Module, in_channels: int, image_size: tuple[int, int]) -> int:
    """Number of values per sample that ``features`` produces for the given input.

    Found by a forward pass on zeros, which draws no random numbers, so the
    caller's seeded parameter initialisation is unaffected. Eval mode keeps any
    batch-norm running statistics untouched.
    """
    was_training = features.training
    features.eval()
    try:
        with torch.no_grad():
            out = features(torch.zeros(1, in_channels, *image_size))
    except RuntimeError as exc:
        raise UsageError(
            f"image size {tuple(image_size)} is too small for this model: {exc}"
        ) from None
    finally:
        features.train(was_training)
    if out.numel() == 0:
        raise UsageError(f"image size {tuple(image_size)} is too small for this model")
    return out.numel()
