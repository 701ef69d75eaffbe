"""Every setting of a training job, with its default, help text and check.

The settings are grouped by concern, one small frozen dataclass per section
(``config.optim.lr``, ``config.sync.servers``, ``config.checkpoint.dir``;
:mod:`convoy.train.sections`). The same sections are the argument groups of
``convoy train --help``, the [tables] of a ``--config`` TOML file and the
objects of a run folder's config.json. Each field's metadata is the one table
the command line, the TOML keys and the help are built from, so a flag and a
config key never disagree: a setting's flat name (``clip_grad_norm``,
``checkpoint_dir``) is its flag (``--clip-grad-norm``, ``--checkpoint-dir``)
and its top-level TOML key; inside its section's table both the flat name and
the field's own name (``[checkpoint] dir``) are accepted.

Example::

    config = TrainConfig.from_flat(model="vgg_fc", sync="ps", nproc=3, steps=20)
    config.optim.lr, config.sync.servers        # (None, None): the settings as given
    job = config.validate()
    job.optim.lr, job.ps_servers()              # (0.0125, "colocated"): as the job runs

Each section checks its own values (``OptimConfig.validate``);
``TrainConfig.validate`` runs them all and then the checks that span sections
(``--sub-batches`` against ``--batch-size``, ``--servers`` against the world).
Validating changes nothing: it returns the job as it runs, a new frozen
config with the defaults that depend on other settings filled in and the values
parsed, and touches nothing outside it.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from convoy.errors import UsageError
from convoy.train.checks import at_least, flag, one_of, positive
from convoy.train.layouts import LAYOUTS, LayoutSpec
from convoy.train.sections import (AMP_NAMES, DEFAULT_LR, OTHER_MODELS_LR, CheckpointConfig, CompressConfig,
                                   DataConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, SyncConfig)
from convoy.train.strategies import STRATEGIES, StrategySpec
from convoy.utils.suggest import did_you_mean
from convoy.utils.toml import read_toml

if TYPE_CHECKING:
    from convoy.parallel.shape import JobShape

__all__ = ["CheckpointConfig", "CompressConfig", "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "RunConfig", "SECTIONS", "Setting", "SyncConfig", "TrainConfig", "build_config", "config_settings",
           "load_toml", "save_config", "settings_by_name", "value_types"]


def _section(kind: type, about: str) -> Any:
    return field(default_factory=kind, metadata={"help": about})


@dataclass(frozen=True)
class TrainConfig:
    """A training job: one object per section, in the order ``convoy train --help`` shows them.

    Build one from flat settings named as their flags with ``from_flat``, from
    the nested dict of a run folder's config.json with ``from_dict``, or from
    the sections themselves; change settings with ``with_settings`` (a new
    config: this one is frozen)::

        TrainConfig(optim=OptimConfig(lr=0.1), run=RunConfig(steps=20)).with_settings(out="runs/a")
    """

    model: ModelConfig = _section(ModelConfig, "the network to train")
    data: DataConfig = _section(DataConfig, "the dataset and how it is batched")
    optim: OptimConfig = _section(OptimConfig, "optimizer and learning rate")
    run: RunConfig = _section(RunConfig, "length, evaluation, output and the worker processes")
    sync: SyncConfig = _section(SyncConfig, "how workers exchange gradients (--sync) and each strategy's options")
    compress: CompressConfig = _section(CompressConfig, "gradient compression and error feedback")
    parallel: ParallelConfig = _section(ParallelConfig, "processes and how the model is laid out over them")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpoints, resuming, and initial weights")

    @classmethod
    def from_flat(cls, **values: Any) -> TrainConfig:
        """A config from settings named as their flags, without the dashes; the others keep their defaults.

        Example::

            TrainConfig.from_flat(compress="blocktopk", block_fraction=0.01, checkpoint_dir="ckpt")
        """
        return cls().with_settings(**values)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> TrainConfig:
        """The config ``to_dict`` returned (a run folder's config.json): one dict per section."""
        return cls(**{f.name: _SECTION_TYPES[f.name](**values.get(f.name, {})) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """One dict per section, field by field: what config.json holds and ``from_dict`` reads back."""
        return dataclasses.asdict(self)

    def with_settings(self, **values: Any) -> TrainConfig:
        """This config with the settings named as their flags (without the dashes) changed.

        Raises:
            TypeError: an unknown setting's name.
        """
        by_name = settings_by_name()
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if name not in by_name:
                raise TypeError(f"unknown setting {name!r}" + did_you_mean(name, by_name))
            setting = by_name[name]
            changes.setdefault(setting.section, {})[setting.attr] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **fields)
                                            for section, fields in changes.items()})

    def sections(self) -> Iterator[Any]:
        """The section objects, in the order of ``SECTIONS``."""
        return (getattr(self, name) for name in SECTIONS)

    def world_size(self) -> int:
        """The job's processes: torchrun's WORLD_SIZE under torchrun (or an emulated cluster), else --nproc."""
        from convoy.runtime import launched_by_torchrun

        return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.parallel.nproc

    def validate(self) -> TrainConfig:
        """The job as it runs; UsageError naming the first bad setting.

        A new config: ``optim.lr`` filled in (the model's rate, scaled for a
        sparse compressor), ``sync.servers`` an int or ``"colocated"``,
        ``sync.shard_weights`` the shares, ``checkpoint.every`` and
        ``full_every`` ints or ``"auto"``, ``run.logger`` a tuple. ``self`` is
        left as given and nothing else is touched (the checkpoint directory is
        created by :func:`build_config` and by the job). Validating the result
        again returns an equal config.

        Names are checked here, before any worker starts; import paths only
        resolve inside the workers, where the user's modules are imported.
        """
        job = dataclasses.replace(self, **{name: section.validate() for name, section in zip(SECTIONS,
                                                                                             self.sections())})
        if job.optim.lr is None:
            job = job.with_settings(lr=DEFAULT_LR.get(job.model.name, OTHER_MODELS_LR)
                                    * job.compress.default_lr_scale())
        job._check_precision()
        strategy, layout = job.strategy_spec(), job.layout_spec()
        if strategy.layouts is not None and layout.name not in strategy.layouts:
            raise UsageError(f"--sync {strategy.name} lays out the job itself, with --parallel "
                             f"{' or '.join(strategy.layouts)}; got --parallel {layout.name}")
        world = job.world_size()
        for spec in (layout, strategy):   # the layout's first: ps reads its roles
            if spec.check is not None:
                spec.check(job, world)
        job.job_shape(world)   # roles and groups fit the world, before any worker starts
        return job

    def strategy_spec(self) -> StrategySpec:
        """The registered spec of ``--sync`` (UsageError naming the choices when there is none)."""
        return STRATEGIES.spec(self.sync.strategy)

    def layout_spec(self) -> LayoutSpec:
        """The registered spec of ``--parallel`` (UsageError naming the choices when there is none)."""
        return LAYOUTS.spec(self.parallel.layout)

    def job_shape(self, world_size: int) -> JobShape:
        """The shape this configuration asks for on ``world_size`` ranks (UsageError where it does not fit):
        the strategy's extra ranks and clusters, the layout's roles."""
        from convoy.parallel.shape import JobShape

        given = {key: value for spec in (self.strategy_spec(), self.layout_spec()) if spec.shape is not None
                 for key, value in spec.shape(self).items()}
        return JobShape(world_size, **given)

    def _check_precision(self) -> None:
        positive("lr", self.optim.lr)
        one_of("amp", self.optim.amp, AMP_NAMES)
        at_least("grad_accum", self.optim.grad_accum, 1)
        if self.optim.clip_grad_norm is not None:
            positive("clip_grad_norm", self.optim.clip_grad_norm)
        if self.optim.amp == "fp16" and self.compress.name != "none":
            # The compressor's error feedback (and momentum correction's clipping and
            # weight decay) would work on gradients still multiplied by the loss scale,
            # and an overflowed step's infinities would stay in its memory.
            raise UsageError(f"--amp fp16 with --compress {self.compress.name}: error feedback would keep the "
                             "loss-scaled gradient (and an overflowed step's inf); use --amp bf16, which needs no "
                             "loss scale, or --compress none")

    def ps_servers(self) -> int | str:
        """``--servers`` as the job runs it: ``"colocated"``, or S dedicated server ranks.

        Colocated servers are the default of data parallelism; a hybrid job
        keeps its conv and FC ranks and defaults to one dedicated server (ps
        lays out both itself, :func:`convoy.train.ps.build_hybrid_ps_layout`).
        """
        if self.sync.servers is not None:
            return self.sync.servers
        return 1 if self.parallel.layout == "hybrid" else "colocated"


SECTIONS: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
_SECTION_TYPES: dict[str, type] = {f.name: f.default_factory  # type: ignore[misc]
                                   for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class Setting:
    """One setting: the field ``attr`` of section ``section``, known outside as ``name``.

    ``name`` is the flat name: ``--name`` with - for _ is its flag, and it is
    its key at the top level of a config file.
    """

    section: str
    field: dataclasses.Field

    @property
    def attr(self) -> str:
        return self.field.name

    @property
    def name(self) -> str:
        return self.field.metadata["flag"] or self.field.name

    @property
    def flag(self) -> str:
        return flag(self.name)

    @property
    def help(self) -> str:
        """Its help line; a registry's choices as registered now."""
        choices = self.field.metadata["choices"]
        text = self.field.metadata["help"]
        return text.replace("{choices}", ", ".join(choices())) if choices is not None else text

    @property
    def default(self) -> Any:
        return self.field.default

    def get(self, config: TrainConfig) -> Any:
        return getattr(getattr(config, self.section), self.attr)


def config_settings() -> list[Setting]:
    """Every setting, section by section, in the order ``convoy train --help`` lists them."""
    return [Setting(section, f) for section, kind in _SECTION_TYPES.items() for f in dataclasses.fields(kind)]


def settings_by_name() -> dict[str, Setting]:
    """Every setting by its flat name (``clip_grad_norm``, ``checkpoint_dir``)."""
    return {setting.name: setting for setting in config_settings()}


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file into flat settings: flat keys, or keys inside their [section] tables; - or _ alike.

    ``lr = 0.1`` at the top and ``[optim]`` ``lr = 0.1`` are the same
    setting; in a table a field's own name works too (``[checkpoint]``
    ``dir = "ckpt"`` is ``checkpoint_dir = "ckpt"``), so the sections of a run
    folder's config.json, written as TOML, are a config file. A key in another
    section's table, an unknown key, or one setting given twice is an error.
    """
    values: dict[str, Any] = {}
    for key, value in read_toml(path, "config file").items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                _put(path, values, _known_key(path, inner, key), inner_value)
        else:
            _put(path, values, _known_key(path, key, None), value)
    return values


def _put(path: str, values: dict[str, Any], name: str, value: Any) -> None:
    if name in values:
        raise UsageError(f"config file {path}: {name} is given twice")
    values[name] = value


def _known_key(path: str, key: str, section: str | None) -> str:
    """The flat name of config-file key ``key``, found at the top level or in ``[section]``."""
    by_name = settings_by_name()
    name = key.replace("-", "_")
    if section is None:
        if name not in by_name:
            raise UsageError(f"config file {path}: unknown key {key!r}; valid keys: {', '.join(by_name)}"
                             + did_you_mean(name, by_name))
        return name
    here = {s.attr: s for s in by_name.values() if s.section == section}
    here.update({s.name: s for s in here.values()})
    if name in here:
        return here[name].name
    if name in by_name:
        raise UsageError(f"config file {path}: {key!r} belongs in [{by_name[name].section}], not [{section}]")
    raise UsageError(f"config file {path}: unknown key [{section}] {key!r}; valid keys: "
                     f"{', '.join(s.attr for s in config_settings() if s.section == section)}"
                     + did_you_mean(name, here))


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """The job ``convoy train`` runs: defaults, then the file, then the flags the user actually gave
    (both by flat name), validated; then the checkpoint directory is created, so that a bad one is
    refused before any worker starts and a refused job leaves none."""
    config = TrainConfig.from_flat(**{**file_values, **flag_values})
    converted: dict[str, Any] = {}
    for setting in config_settings():
        value = setting.get(config)
        if value is None:
            continue
        kinds = value_types(setting)
        if tuple in kinds and isinstance(value, list):   # a TOML list
            value = converted[setting.name] = tuple(value)
        if kinds == (float,) and isinstance(value, int) and not isinstance(value, bool):
            converted[setting.name] = float(value)
        elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UsageError(f"{setting.name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    job = config.with_settings(**converted).validate()
    if job.checkpoint.dir is not None:
        from convoy.checkpoint.session import check_directory

        check_directory(job.checkpoint.dir)
    return job


def value_types(setting: Setting) -> tuple[type, ...]:
    """The types a setting's value may have, from its annotation (``str | int`` -> (str, int)); the first
    is the one a flag's text is converted to."""
    hint = typing.get_type_hints(_SECTION_TYPES[setting.section])[setting.attr]
    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(typing.get_origin(part) or part for part in parts if part is not type(None))


def save_config(config: TrainConfig, out_dir: Path) -> None:
    """Write config.json into the run folder: one object per section, as ``TrainConfig.from_dict`` reads it."""
    import json

    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
