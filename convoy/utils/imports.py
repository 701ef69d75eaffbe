"""Resolve ``package.module:attribute`` and ``path/to/file.py:attribute`` strings to Python objects."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from convoy.errors import UsageError
from convoy.utils.suggest import did_you_mean


def is_import_path(name: str) -> bool:
    """True when ``name`` looks like ``package.module:attribute`` or ``path/to/file.py:attribute``."""
    module, sep, attr = name.rpartition(":")
    return bool(sep and module and attr)


def load_object(path: str) -> Any:
    """Import ``package.module:attribute`` or ``path/to/file.py:attribute`` and return the attribute.

    A ``.py`` path is loaded as a module of its own, with its folder put on
    ``sys.path`` so it can import its neighbours, the way ``python file.py``
    would; no PYTHONPATH is needed. ``attribute`` may be dotted (``Class.method``).

    Raises:
        ValueError: the path is malformed, the module or file cannot be imported,
            or it has no such attribute.

    Example::

        >>> load_object("models/mine.py:build")      # relative to the current directory
        >>> load_object("mypackage.nets:build")      # the current directory is importable
    """
    if not is_import_path(path):
        raise ValueError(f"{path!r} is not an import path of the form package.module:factory "
                         "or path/to/file.py:factory")
    module_name, _, attr = path.rpartition(":")
    module = _import_file(module_name) if module_name.endswith(".py") else _import_module(module_name, path)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}" + did_you_mean(part, dir(obj)))
        obj = getattr(obj, part)
    return obj


def cwd_importable() -> None:
    """Put the current directory on ``sys.path``, as ``python -m`` does, so ``package.module`` resolves there.

    The ``convoy`` console script (unlike ``python -m convoy``) does not; the
    launcher and every worker call this before importing a user's factory.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _import_module(module_name: str, path: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {exc}") from None


def _import_file(file: str) -> ModuleType:
    location = Path(file).resolve()
    if not location.is_file():
        raise ValueError(f"no file {file} (from {Path.cwd()})")
    # One module per file, whichever spelling of the path named it.
    name = f"convoy_user_{location.stem}_{hashlib.sha1(str(location).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, location)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(location.parent) not in sys.path:
        sys.path.insert(0, str(location.parent))
    sys.modules[name] = module   # before running it: dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as exc:   # others are bugs in the file: their traceback helps
        del sys.modules[name]
        raise ValueError(f"importing {file} failed: {type(exc).__name__}: {exc}") from None
    return module


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
