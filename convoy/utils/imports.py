"""Resolve ``package.module:attribute`` strings to Python objects."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from convoy.errors import UsageError


def is_import_path(name: str) -> bool:
    """True when ``name`` looks like ``package.module:attribute``."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def load_object(path: str) -> Any:
    """Import ``package.module:attribute`` and return the attribute.

    Raises:
        ValueError: the path is malformed, the module cannot be imported, or it
            has no such attribute.
    """
    if not is_import_path(path):
        raise ValueError(f"{path!r} is not an import path of the form package.module:factory")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def call_with_supported(factory: Callable[..., Any], **kwargs: Any) -> Any:
    """Call ``factory`` with the subset of ``kwargs`` its signature accepts.

    User factories need not know about every argument convoy can offer
    (input channels, number of classes, ...); they take what they declare.
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory()
    # A factory that needs more than convoy offers (os:system needs a command) is
    # refused by name rather than called into a TypeError.
    required = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise UsageError(f"{getattr(factory, '__qualname__', factory)!s} needs the argument {required[0]!r}; "
                         f"convoy passes only: {', '.join(kwargs)}")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory(**kwargs)
    return factory(**{k: v for k, v in kwargs.items() if k in params})
