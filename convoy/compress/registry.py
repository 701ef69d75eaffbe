"""The one list of gradient compressors: each compressor's module registers its spec.

``convoy train --compress``, the TOML ``compress`` key, :func:`convoy.ddp.comm_hook`,
the planner and the simulator read the names (and what each compressor is: sparse,
momentum-corrected, offered as a DDP hook) from here, so adding a compressor is its
own module (ending in a :func:`register` call) plus its tests.

Example::

    >>> from convoy.compress import build_compressor, compressor_names
    >>> compressor_names()
    ('none', 'fp16', 'blocktopk', 'topk', 'randomk', 'powersgd')
    >>> compressor, memory = build_compressor("topk", element_fraction=0.01)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from convoy.compress.base import Compressor, Memory
from convoy.errors import UsageError


@dataclass(frozen=True)
class CompressorSpec:
    """What convoy knows of one compressor besides its class.

    Args:
        name: its ``--compress`` name.
        build: ``(**options) -> (compressor, error-feedback memory)``; its keyword
            defaults are the compressor's defaults (the owner's, read by everyone).
        options: the settings ``build`` takes, by their ``convoy train`` names
            (e.g. ``element_fraction``); :func:`build_compressor` passes it those
            and drops the others, which belong to other compressors.
        sparse: it sends a share of each layer's values (DGC's momentum masking,
            the sparse learning-rate scale and full checkpoints apply).
        momentum_corrected: momentum correction applies to it (with SGD and momentum).
        hook_options: offered as a DDP communication hook (:func:`convoy.ddp.comm_hook`)
            taking these options: the hook's name for each -> its name in ``options``;
            None: not a hook.

    Example::

        >>> register(CompressorSpec("half", lambda: (FP16Compressor(), ResidualMemory()), hook_options={}))
    """

    name: str
    build: Callable[..., tuple[Compressor, Memory]]
    options: tuple[str, ...] = ()
    sparse: bool = False
    momentum_corrected: bool = False
    hook_options: Mapping[str, str] | None = field(default=None)


# Registration order is the order names are listed in (help, error messages).
_SPECS: dict[str, CompressorSpec] = {}


def register(spec: CompressorSpec) -> CompressorSpec:
    """Add ``spec`` to the registry (a name registered twice is refused) and return it.

    Args:
        spec: the compressor's spec; its ``hook_options`` must name its own ``options``.
    """
    if spec.name in _SPECS:
        raise ValueError(f"compressor {spec.name!r} is already registered")
    unknown = set((spec.hook_options or {}).values()) - set(spec.options)
    if unknown:
        raise ValueError(f"compressor {spec.name!r}: hook options map to unknown options {sorted(unknown)}")
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove the compressor called ``name`` (a plug-in's tests clean up with this)."""
    del _SPECS[name]


def compressor_names() -> tuple[str, ...]:
    """Every registered compressor's name, in registration order."""
    return tuple(_SPECS)


def sparse_names() -> tuple[str, ...]:
    """The registered compressors that send a share of each layer."""
    return tuple(name for name, spec in _SPECS.items() if spec.sparse)


def momentum_corrected_names() -> tuple[str, ...]:
    """The registered compressors momentum correction applies to."""
    return tuple(name for name, spec in _SPECS.items() if spec.momentum_corrected)


def compressor_spec(name: str) -> CompressorSpec:
    """The spec registered as ``name``.

    Raises:
        UsageError: no compressor of that name; one line naming the registered ones.
    """
    if name not in _SPECS:
        raise UsageError(f"unknown compressor {name!r}; choose one of: {', '.join(_SPECS)}")
    return _SPECS[name]


def build_compressor(name: str, **options: Any) -> tuple[Compressor, Memory]:
    """Return the compressor called ``name`` and the error-feedback memory it uses.

    Args:
        name: one of :func:`compressor_names`.
        **options: settings by their ``convoy train`` names; each compressor takes
            its own (``blocks_per_layer``, ``block_fraction``, ``block_metric``,
            ``block_selection``, ``block_size``, ``dense_below``: blocktopk;
            ``element_fraction``: topk and randomk; ``powersgd_rank``: powersgd) and
            ignores the others, so one call can pass a whole job's settings.

    Raises:
        UsageError: an unknown name.
        TypeError: an option no registered compressor takes.

    Example::

        >>> compressor, memory = build_compressor("blocktopk", block_fraction=0.01)
    """
    spec = compressor_spec(name)
    unknown = set(options) - {option for s in _SPECS.values() for option in s.options}
    if unknown:
        raise TypeError(f"build_compressor() got unexpected options {', '.join(sorted(unknown))}")
    return spec.build(**{key: value for key, value in options.items() if key in spec.options})


__all__ = ["CompressorSpec", "build_compressor", "compressor_names", "compressor_spec", "momentum_corrected_names",
           "register", "sparse_names", "unregister"]
