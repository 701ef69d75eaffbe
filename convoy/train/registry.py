"""The registries of a training job's choices: ``--sync`` strategies and ``--parallel`` layouts.

Each is one :class:`Registry` of frozen specs (:class:`convoy.train.strategies.StrategySpec`,
:class:`convoy.train.layouts.LayoutSpec`), keyed by the name the flag takes. The command
line's help, the config's checks (``convoy train`` flags and TOML keys alike), the job's
shape and process groups, the layout a worker builds and the way an elastic resume maps a
checkpoint are all read from the spec of the name given, so adding a strategy or a layout
is one module ending in a ``register`` call, plus its tests.

Why here and not in :mod:`convoy.sync` / :mod:`convoy.parallel`: those packages own the
mechanisms (``AllReduce``, ``Hierarchical``, ``DataParallel``, ``HybridParallel``,
``ParameterServerLayout``) and know nothing of a job's settings, while every field of a
spec is read by :mod:`convoy.train` and takes its ``TrainConfig`` (``--sync ps`` is not
even a :mod:`convoy.sync` strategy: it lays out servers and workers itself). A registry
below would have to hold callables of a type it may not name (the import contracts
forbid :mod:`convoy.sync` and :mod:`convoy.parallel` to import :mod:`convoy.train`) and
would stay empty until :mod:`convoy.train` filled it. So the choice of a strategy or a
layout is :mod:`convoy.train`'s: this module and the two spec modules import nothing of
the job (the config's sections read them), and :mod:`convoy.train.builtins`, imported by
the package, registers the built-in specs with their builders and hooks.

Example::

    >>> from convoy.train.strategies import STRATEGIES
    >>> STRATEGIES.names()
    ('allreduce', 'hierarchical', 'ps')
    >>> STRATEGIES.spec("zip")
    Traceback (most recent call last):
    convoy.errors.UsageError: unknown --sync 'zip'; choose one of: allreduce, hierarchical, ps
"""
from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from convoy.train.checks import one_of


class _Named(Protocol):
    @property
    def name(self) -> str: ...


S = TypeVar("S", bound=_Named)


class Registry(Generic[S]):
    """The specs of one flag's choices, in registration order (the order help and errors list them).

    Args:
        setting: the flat name of the setting that takes the names (``sync``: ``--sync``).

    Example::

        >>> LAYOUTS.register(LayoutSpec("pipeline", build_pipeline))
        >>> LAYOUTS.unregister("pipeline")   # a plug-in's tests clean up with this
    """

    def __init__(self, setting: str):
        self.setting = setting
        self._specs: dict[str, S] = {}

    def register(self, spec: S) -> S:
        """Add ``spec`` (a name registered twice is refused with ValueError) and return it."""
        if spec.name in self._specs:
            raise ValueError(f"--{self.setting} {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove the spec registered as ``name``."""
        del self._specs[name]

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._specs)

    def specs(self) -> tuple[S, ...]:
        """Every registered spec, in registration order."""
        return tuple(self._specs.values())

    def spec(self, name: str) -> S:
        """The spec registered as ``name``.

        Raises:
            UsageError: no spec of that name; one line naming the registered ones.
        """
        one_of(self.setting, name, self.names())
        return self._specs[name]


__all__ = ["Registry"]
