"""Every default is defined once: the CLI, the simulator, the planner and the library read the owner's.

Each option of ``convoy train``, ``convoy simulate`` and ``convoy plan`` is listed
below with the component that owns its default (a compressor module, the ps
settings, the cluster plan, the checkpoint schedule, the simulator's Cluster, ...),
or as the command's own setting. The tests parse the argparse parsers and check,
option by option, that the default a user gets and the one ``--help`` states are
the owner's, and that no option is left out: a default changed in one place
cannot leave another stale, and a new option has to name its owner here.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest
from convoy.checkpoint.schedule import DEFAULT_BUDGET, DEFAULT_FULL_EVERY, DEFAULT_RANK_FILES
from convoy.cli.main import build_parser
from convoy.cluster import (DEFAULT_CLUSTERS, DEFAULT_REELECT_EVERY, DEFAULT_SERVER_CHOICE, DEFAULT_WEIGHTS,
                            INDICATORS, Election, make_plan)
from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_PER_LAYER, DEFAULT_DENSE_BELOW,
                             DEFAULT_ELEMENT_FRACTION, DEFAULT_METRIC, DEFAULT_POWERSGD_RANK, DEFAULT_SELECTION,
                             BlockTopKCompressor, PowerSGDCompressor, build_compressor)
from convoy.data import digits
from convoy.ps.settings import (DEFAULT_CHANNELS, DEFAULT_CREDIT_KB, DEFAULT_PRIORITY, DEFAULT_SLICE_KB,
                                PSSettings)
from convoy.runtime import DEFAULT_TIMEOUT_S
from convoy.sim.catalog import STRATEGY_NAMES, Knobs
from convoy.sim.cluster import Cluster
from convoy.sim.codec import Compression
from convoy.sim.strategies import ClusterCycles, ServerShards
from convoy.sim.strategies.hierarchical import SIMULATED_CLUSTERS
from convoy.sync.hierarchical import DEFAULT_EXCHANGE_EVERY
from convoy.train.config import settings_by_name
from convoy.train.sections import DEFAULT_EPOCHS, DEFAULT_LR, OTHER_MODELS_LR, SPARSE_WARMUP_STEPS


@dataclasses.dataclass(frozen=True)
class Stated:
    """No parser default (the value depends on other settings); the help states the owner's in words."""
    text: str


OWN = object()    # the command's own setting: its definition is the parser's (train: its section's field)
NONE = object()   # no default: unset unless given
SWITCH = object()  # a store_true flag: off unless given

_CLUSTER = {f.name: f.default for f in dataclasses.fields(Cluster)}

# convoy train: the flat setting names of convoy/train/sections.py.
TRAIN: dict[str, Any] = {
    # The default job (lenet on digits, 2 workers, 60 epochs), chosen by bench/default_job.py: train's own.
    "model": OWN, "dataset": OWN, "data_dir": NONE, "synthetic_shape": OWN, "batch_size": OWN,
    "optimizer": OWN, "momentum": OWN, "weight_decay": OWN, "lr_schedule": OWN, "amp": OWN, "grad_accum": OWN,
    "clip_grad_norm": NONE,
    "lr": Stated("default per model: " + ", ".join(f"{m} {lr}" for m, lr in DEFAULT_LR.items())
                 + f", others {OTHER_MODELS_LR}"),
    "steps": NONE, "epochs": Stated(f"default {DEFAULT_EPOCHS} when --steps is not given"),
    "eval_every": OWN, "stop_at_accuracy": NONE, "seed": OWN, "out": Stated("default runs/<time>"), "logger": OWN,
    "threads": OWN, "progress": OWN, "device": OWN,
    "timeout": DEFAULT_TIMEOUT_S,                               # convoy.runtime
    "sync": OWN,
    "clusters": DEFAULT_CLUSTERS, "reelect_every": DEFAULT_REELECT_EVERY,    # convoy.cluster
    "server_choice": DEFAULT_SERVER_CHOICE,
    "indicator_weights": Stated("default " + ",".join(f"{DEFAULT_WEIGHTS[n]:g}" for n in INDICATORS)),
    "node_profile": NONE,
    "exchange_every": DEFAULT_EXCHANGE_EVERY,                   # convoy.sync.hierarchical
    "servers": Stated("colocated (every rank serves a shard of the parameters and trains; the default with "
                      "--parallel data)"),
    "staleness": PSSettings.staleness, "priority": DEFAULT_PRIORITY,   # convoy.ps.settings
    "channels": Stated(f"(default {DEFAULT_CHANNELS};"), "slice_kb": Stated(f"(default {DEFAULT_SLICE_KB:g};"),
    "credit_kb": Stated(f"(default {DEFAULT_CREDIT_KB:g};"), "shard_weights": Stated("default: equal shares"),
    "trace": OWN, "trace_steps": OWN,
    "compress": OWN,
    "blocks_per_layer": Stated(f"(default {DEFAULT_BLOCKS_PER_LAYER};"), "block_fraction": NONE,   # convoy.compress
    "block_metric": DEFAULT_METRIC, "block_selection": DEFAULT_SELECTION, "element_fraction": DEFAULT_ELEMENT_FRACTION,
    "block_size": DEFAULT_BLOCK_SIZE, "dense_below": DEFAULT_DENSE_BELOW, "powersgd_rank": DEFAULT_POWERSGD_RANK,
    "warmup_steps": Stated(f"(default: {SPARSE_WARMUP_STEPS} for the former, 0 otherwise)"),
    "momentum_masking": OWN, "momentum_correction": OWN, "clip_norm": OWN, "sparse_lr_scale": OWN,
    "nproc": OWN, "parallel": OWN, "conv_workers": NONE, "fc_workers": NONE, "sub_batches": OWN,
    "split_at": Stated("default: the model's classifier"),
    "checkpoint_dir": NONE, "checkpoint_every": OWN,
    "checkpoint_budget": DEFAULT_BUDGET, "checkpoint_full_every": DEFAULT_FULL_EVERY,   # convoy.checkpoint
    "checkpoint_rank_files": DEFAULT_RANK_FILES,
    "resume": Stated("default: resume if it holds one"), "init_from": NONE,
}

# The model options convoy simulate and convoy plan share (convoy/cli/sim_args.py).
_MODEL_ARGS: dict[str, Any] = {
    "model": OWN,   # vgg_fc, whose large FC head makes the network matter, is the example a prediction is about
    "profile": NONE, "save_profile": NONE, "json": SWITCH,
    "batch_size": settings_by_name()["batch_size"].default,      # convoy train's default job
    "input_shape": ",".join(str(d) for d in (digits.CHANNELS, *digits.IMAGE_SIZE)),   # convoy.data.digits
}
SIMULATE: dict[str, Any] = {
    **_MODEL_ARGS,
    "cluster": NONE, "nodes": OWN, "rate": OWN, "inter_rack_rate": NONE,
    "racks": _CLUSTER["racks"], "latency_ms": _CLUSTER["latency_s"] * 1e3,   # convoy.sim.cluster.Cluster
    "wake_ms": _CLUSTER["wake_s"] * 1e3, "lanes": _CLUSTER["lanes"],
    "cores": Stated("default: a core per thread"),
    "strategy": list(STRATEGY_NAMES),
    "element_fraction": DEFAULT_ELEMENT_FRACTION, "blocks_per_layer": Stated(f"default: {DEFAULT_BLOCKS_PER_LAYER}"),
    "block_fraction": NONE, "block_selection": DEFAULT_SELECTION, "block_size": DEFAULT_BLOCK_SIZE,
    "powersgd_rank": DEFAULT_POWERSGD_RANK,
    # train's auto needs profiled nodes; the simulator has none, so it takes a count (convoy.sim's own).
    "clusters": SIMULATED_CLUSTERS, "exchange_every": DEFAULT_EXCHANGE_EVERY,
    # Dedicated servers: the simulator has no model of convoy train's colocated ones.
    "servers": PSSettings.servers, "priority": DEFAULT_PRIORITY, "slice_kb": DEFAULT_SLICE_KB,
    "conv_workers": Stated("default: nodes - J"), "fc_workers": Stated("default: nodes / 4"),
}
PLAN: dict[str, Any] = {
    **_MODEL_ARGS,
    "top": OWN, "steps_to_target": NONE, "master_addr": Stated("default: node 0's host"),
    # The port torchrun takes when given none (its parser leaves it None and falls back to 29500 inside);
    # plan prints it in every command, so the commands do not depend on that fallback.
    "master_port": OWN,   # convoy.cli.plan.DEFAULT_MASTER_PORT
}
OWNERS = {"train": TRAIN, "simulate": SIMULATE, "plan": PLAN}


def _subparser(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _options(name: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _subparser(name)._actions if a.option_strings and a.dest not in ("help", "config")}


def _help(action: argparse.Action) -> str:
    """The option's line as --help prints it (``%(default)s`` expanded)."""
    return (action.help or "") % {**vars(action), "prog": "convoy"} if "%" in (action.help or "") else action.help


def _shown(value: Any) -> set[str]:
    """How --help may print ``value``: as str() does (train's help, %(default)s) or as %(default)g."""
    return {str(value), f"{value:g}"} if isinstance(value, float) else {str(value)}


def _default(command: str, action: argparse.Action) -> Any:
    """What the option is when not given: the parser's default (train: its setting's, the parser suppresses it)."""
    return settings_by_name()[action.dest].default if command == "train" else action.default


@pytest.mark.parametrize("command", OWNERS)
def test_every_option_names_the_owner_of_its_default(command):
    assert sorted(_options(command)) == sorted(OWNERS[command])


@pytest.mark.parametrize("command, dest", [(c, d) for c, owners in OWNERS.items() for d in owners])
def test_each_default_and_its_help_are_the_owners(command, dest):
    action, owner = _options(command)[dest], OWNERS[command][dest]
    default, text = _default(command, action), _help(action)
    if owner is NONE or isinstance(owner, Stated):
        assert default is None, f"convoy {command} --{dest}: {default!r}"
        if isinstance(owner, Stated):
            assert owner.text in text, f"convoy {command} --{dest}'s help: {text!r}"
        return
    if owner is SWITCH:
        assert isinstance(action, argparse._StoreTrueAction) and default is False
        return
    if owner is not OWN:
        assert default == owner, f"convoy {command} --{dest}: {default!r}, its owner's {owner!r}"
    if isinstance(action, argparse._AppendAction):   # a repeatable flag, empty unless given
        return
    stated = {"all"} if default == list(STRATEGY_NAMES) else _shown(default)
    assert any(f"(default: {s}" in text for s in stated), f"convoy {command} --{dest}'s help: {text!r}"


def test_the_simulators_knobs_are_convoy_simulates_defaults():
    """``Knobs`` (what plan's from_flags fills in for a flag a command leaves out) defaults as the CLI does."""
    options = _options("simulate")
    for field in dataclasses.fields(Knobs):
        assert field.default == options[field.name].default, field.name
    assert (ClusterCycles().clusters, ClusterCycles().exchange_every) == (SIMULATED_CLUSTERS, DEFAULT_EXCHANGE_EVERY)
    shards = ServerShards()
    assert (shards.servers, shards.priority, shards.slice_kb) == (PSSettings.servers, DEFAULT_PRIORITY,
                                                                  DEFAULT_SLICE_KB)
    assert Compression("blocktopk").selection == DEFAULT_SELECTION


def test_the_library_plans_clusters_as_convoy_train_does():
    election = Election([[0, 1], [2, 3]])
    assert (election.every, election.choice) == (TRAIN["reelect_every"], TRAIN["server_choice"])
    defaults = {name: p.default for name, p in inspect.signature(make_plan).parameters.items()}
    assert (defaults["clusters"], defaults["reelect_every"], defaults["server_choice"]) == (
        TRAIN["clusters"], TRAIN["reelect_every"], TRAIN["server_choice"])


def test_train_config_takes_the_compressors_defaults():
    settings = settings_by_name()
    assert settings["block_metric"].default == DEFAULT_METRIC
    assert settings["block_size"].default == DEFAULT_BLOCK_SIZE
    assert settings["dense_below"].default == DEFAULT_DENSE_BELOW
    assert settings["powersgd_rank"].default == DEFAULT_POWERSGD_RANK


def test_the_library_builds_what_convoy_train_builds():
    settings = settings_by_name()
    blocktopk, _ = build_compressor("blocktopk", block_fraction=0.01)
    assert (blocktopk.metric, blocktopk.block_size, blocktopk.dense_below, blocktopk.selection) == (
        settings["block_metric"].default, settings["block_size"].default, settings["dense_below"].default,
        settings["block_selection"].default)
    assert BlockTopKCompressor().metric == settings["block_metric"].default
    assert BlockTopKCompressor().blocks_per_layer == DEFAULT_BLOCKS_PER_LAYER
    assert build_compressor("powersgd")[0].rank == PowerSGDCompressor().rank == settings["powersgd_rank"].default
    for name in ("topk", "randomk"):
        assert build_compressor(name)[0].fraction == settings["element_fraction"].default == DEFAULT_ELEMENT_FRACTION
    assert Compression("topk").fraction == Knobs().element_fraction == DEFAULT_ELEMENT_FRACTION


def test_ps_settings_resolve_to_the_defaults_the_help_states():
    resolved = PSSettings.resolve(servers=1)
    assert resolved.priority == settings_by_name()["priority"].default
    assert resolved.credit_bytes == DEFAULT_CREDIT_KB * 1024
    assert resolved.slice_bytes == DEFAULT_SLICE_KB * 1024
    assert resolved.channels == DEFAULT_CHANNELS


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_simulator_defaults_are_convoy_trains(command):
    """Every option the simulator shares with convoy train (same dest) has train's default, but the two
    the simulator must choose otherwise (model: the example; clusters: a count, it has no profiles)."""
    settings, checked = settings_by_name(), 0
    for dest, action in _options(command).items():
        if dest in ("model", "clusters"):
            continue
        if dest in settings and settings[dest].default is not None and action.default is not None:
            assert action.default == settings[dest].default, f"convoy {command} --{dest.replace('_', '-')}"
            checked += 1
    assert checked >= (7 if command == "simulate" else 1)
