"""Find where a model's convolutional part ends and its fully-connected head begins.

Hybrid training replicates the two parts differently. The returned parts share
their parameters with the model (no copies), and ``head(features(x))`` computes
exactly what ``model(x)`` does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from torch import nn

from convoy.errors import UsageError

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NO_BOUNDARY = (
    "model has no conv/FC boundary: expose `features` and `classifier`, "
    "use an nn.Sequential, or pass --split-at MODULE"
)


def split_point(model: nn.Module, split_at: str | None = None) -> tuple[nn.Module, nn.Module]:
    """Split ``model`` into ``(feature_part, head_part)``.

    Rules, first match wins:

    1. ``split_at`` names a direct child of ``model``: the feature part is the
       children before it, the head is that child and those after it. This
       assumes ``model.forward`` applies its children one after another in
       registration order -- true for ``nn.Sequential``, not checked otherwise.
    2. ``model`` has children ``features`` and ``classifier``: those two.
    3. ``model`` is an ``nn.Sequential`` (nested ones are flattened) whose last
       convolution precedes its first ``nn.Linear``: the head starts at the first
       ``nn.Flatten`` or ``nn.Linear`` after that convolution.

    Raises:
        UsageError: ``split_at`` names no child, or no boundary can be found.
    """
    children = dict(model.named_children())
    if split_at is not None:
        return _split_at_child(children, split_at)
    if "features" in children and "classifier" in children:
        return children["features"], children["classifier"]
    if isinstance(model, nn.Sequential):
        return _split_sequential(list(_flatten(model)))
    raise UsageError(_NO_BOUNDARY)


def _split_at_child(children: dict[str, nn.Module], name: str) -> tuple[nn.Module, nn.Module]:
    names = list(children)
    if name not in children:
        listed = ", ".join(names) if names else "(none)"
        raise UsageError(
            f"--split-at {name!r} names no module of the model; its children are: {listed}"
        )
    cut = names.index(name)
    if cut == 0:
        # An empty feature part has no parameters to replicate and is almost
        # certainly a mistake for a model that has a feature extractor.
        raise UsageError(
            f"--split-at {name!r} is the model's first module, leaving no feature part"
        )
    items = list(children.items())
    return nn.Sequential(OrderedDict(items[:cut])), nn.Sequential(OrderedDict(items[cut:]))


def _flatten(module: nn.Module) -> Iterator[nn.Module]:
    """The leaves of nested ``nn.Sequential`` containers, in execution order."""
    for child in module.children():
        if isinstance(child, nn.Sequential):
            yield from _flatten(child)
        else:
            yield child


def _contains(module: nn.Module, kinds: type | tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in module.modules())


def _split_sequential(layers: list[nn.Module]) -> tuple[nn.Module, nn.Module]:
    conv_at = [i for i, m in enumerate(layers) if _contains(m, _CONV)]
    linear_at = [i for i, m in enumerate(layers) if _contains(m, nn.Linear)]
    if not conv_at or not linear_at or linear_at[0] <= conv_at[-1]:
        raise UsageError(_NO_BOUNDARY)
    # Pooling and activations after the last conv stay in the feature part, so
    # the tensor handed to the head is the last conv block's output.
    first_linear = linear_at[0]
    head_at = next(
        i
        for i in range(conv_at[-1] + 1, first_linear + 1)
        if i == first_linear or isinstance(layers[i], nn.Flatten)
    )
    return nn.Sequential(*layers[:head_at]), nn.Sequential(*layers[head_at:])
