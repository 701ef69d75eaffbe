"""``convoy train``: the options, the local launcher, and the worker's entry."""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import NoReturn

from convoy.cli.errors import report_failure, run_and_exit
from convoy.cli.launch import launch
from convoy.errors import UsageError
from convoy.runtime import launched_by_torchrun
from convoy.train.config import (SECTIONS, Setting, TrainConfig, build_config, config_settings, load_toml,
                                 value_types)
from convoy.train.optim import resolve_optimizer
from convoy.utils.imports import cwd_importable, is_import_path, load_object

DESCRIPTION = """\
Train a CNN with layer-wise pipelined synchronisation.

Locally, `convoy train --nproc N` starts N worker processes on this machine.
Under torchrun (`torchrun --nnodes ... --nproc-per-node ... -m convoy train ...`)
each process is one worker and --nproc is ignored. Settings come from the
defaults, then a TOML file (--config: keys as below with _ for -, at the top
level or in the table of their group, e.g. [optim] lr = 0.1), then flags.
The run folder's config.json holds the settings group by group.
--model and --dataset also take path/to/file.py:factory (see docs/cli.md for
the arguments a factory gets).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a model (locally or under torchrun)",
                                   description=DESCRIPTION, usage="convoy train [--config FILE] [options]",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below, as flat "
                        "keys (lr = 0.1) or in their section's table ([optim] lr = 0.1)")
    groups = {name: parser.add_argument_group(name, about) for name, about in SECTIONS.items()}
    for setting in config_settings():
        _add_option(groups[setting.section], setting)
    parser.set_defaults(func=run)
    worker = subparsers.add_parser("_worker")
    worker.add_argument("config_json")
    worker.set_defaults(func=run_worker_from_file)


_METAVARS = {int: "N", float: "X", str: "VALUE"}


def _add_option(parser: argparse._ActionsContainer, setting: Setting) -> None:
    default = "" if setting.default is None else f" (default: {setting.default})"
    kind = value_types(setting)[0]
    if kind is bool:
        parser.add_argument(setting.flag, dest=setting.name, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=setting.help + default)
        return
    if kind is tuple:   # a repeatable flag
        parser.add_argument(setting.flag, dest=setting.name, action="append", default=argparse.SUPPRESS,
                            metavar=setting.name.upper(), help=setting.help)
        return
    parser.add_argument(setting.flag, dest=setting.name, type=kind, default=argparse.SUPPRESS,
                        metavar=_METAVARS[kind], help=setting.help + default)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    flags = {s.name: getattr(args, s.name) for s in config_settings() if hasattr(args, s.name)}
    return build_config(load_toml(args.config) if args.config else {}, flags)


def run(args: argparse.Namespace) -> int:
    cwd_importable()
    config = config_from_args(args)
    if launched_by_torchrun():
        run_worker(config)
    check_import_paths(config)
    if config.run.out is None:
        config = config.with_settings(out=time.strftime("runs/%Y%m%d-%H%M%S"))
    return launch(json.dumps(config.to_dict()), config.parallel.nproc)


def check_import_paths(config: TrainConfig) -> None:
    """Import the user's model and dataset factories in the launcher, so a bad path is one line, before any worker."""
    for flag, value in (("--model", config.model.name), ("--dataset", config.data.dataset)):
        if is_import_path(value):
            try:
                load_object(value)
            except ValueError as exc:
                raise UsageError(f"{flag}: {exc}") from None
    resolve_optimizer(config.optim.name)


def run_worker_from_file(args: argparse.Namespace) -> NoReturn:
    with open(args.config_json) as f:
        run_worker(TrainConfig.from_dict(json.load(f)).validate())


def run_worker(config: TrainConfig) -> NoReturn:
    """Train as one rank; never leave the job hanging on failure."""
    from convoy.runtime import shutdown
    from convoy.train.loop import run as train

    from convoy.utils.lifetime import StopRequest, die_with_parent

    rank = int(os.environ.get("RANK", 0))
    die_with_parent(os.getppid())   # under torchrun, the agent; locally, convoy's launcher
    cwd_importable()

    def body() -> None:
        # SIGTERM/SIGINT/SIGHUP (from convoy's launcher, torchrun's agent or a user) end the
        # run after a step every rank agrees on, with a checkpoint of it; see StopRequest. Within
        # a bound, whatever the other ranks do: one line says so if they never agreed.
        summary = train(config, StopRequest.install(overdue=lambda exc: report_failure(exc, rank)))
        shutdown()
        if rank == 0:
            print(summary.line(), flush=True)

    run_and_exit(body, rank)
