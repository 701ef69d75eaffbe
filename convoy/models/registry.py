"""Turn a model name from the command line into an ``nn.Module``."""
from __future__ import annotations

from typing import Callable

from torch import nn

from convoy.errors import UsageError
from convoy.models.lenet import lenet
from convoy.models.resnet18 import resnet18
from convoy.models.vgg_fc import vgg_fc
from convoy.utils.imports import call_with_supported, is_import_path, load_object

_BUILTINS: dict[str, Callable[..., nn.Module]] = {
    "lenet": lenet,
    "vgg_fc": vgg_fc,
    "resnet18": resnet18,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILTINS)


def build_model(
    name: str,
    *,
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: tuple[int, int] = (32, 32),
) -> nn.Module:
    """Build a built-in model or call a user factory given as ``package.module:factory``.

    The factory receives whichever of ``in_channels``, ``num_classes`` and
    ``image_size`` its signature declares. Parameters are initialised from the
    torch RNG as it stands, so seed it first for reproducible weights.

    Raises:
        UsageError: unknown name, unimportable factory, bad sizes, or a factory
            that does not return an ``nn.Module``.
    """
    _check_sizes(in_channels, num_classes, image_size)
    if name in _BUILTINS:
        factory = _BUILTINS[name]
    elif is_import_path(name):
        try:
            factory = load_object(name)
        except ValueError as exc:
            raise UsageError(f"cannot load model factory: {exc}") from None
        if not callable(factory):
            raise UsageError(f"model factory {name!r} is not callable")
    else:
        raise UsageError(
            f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}, "
            "or path/to/file.py:factory or package.module:factory"
        )
    model = call_with_supported(
        factory, in_channels=in_channels, num_classes=num_classes, image_size=tuple(image_size)
    )
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _check_sizes(in_channels: int, num_classes: int, image_size: tuple[int, int]) -> None:
    """Reject sizes that would otherwise fail deep inside torch with a cryptic message."""
    if in_channels < 1:
        raise UsageError(f"in_channels must be at least 1, got {in_channels}")
    if num_classes < 1:
        raise UsageError(f"num_classes must be at least 1, got {num_classes}")
    if len(image_size) != 2 or min(image_size) < 1:
        raise UsageError(f"image_size must be two positive integers, got {tuple(image_size)}")
