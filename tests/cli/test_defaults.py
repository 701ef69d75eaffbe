"""Every default is defined once: the CLI, the simulator, the planner and the library read the owner's.

Each test names the owner (a compressor module, the ps settings, convoy train's
config) and checks that what a user sees (``--help``, a parser default, a
library constructor) equals it, so a default changed in one place cannot leave
another stale.
"""
from __future__ import annotations

import argparse
import re

import pytest

from convoy.cli.main import build_parser
from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_DENSE_BELOW, DEFAULT_ELEMENT_FRACTION, DEFAULT_METRIC,
                             DEFAULT_POWERSGD_RANK, BlockTopKCompressor, PowerSGDCompressor, build_compressor)
from convoy.ps.settings import DEFAULT_CHANNELS, DEFAULT_CREDIT_KB, DEFAULT_SLICE_KB, PSSettings
from convoy.sim.catalog import Knobs
from convoy.sim.codec import Compression
from convoy.train.config import settings_by_name


def _subparser(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _defaults(name: str) -> dict[str, object]:
    return {a.dest: a.default for a in _subparser(name)._actions if a.dest != "help"}


def test_train_config_takes_the_compressors_defaults():
    settings = settings_by_name()
    assert settings["block_metric"].default == DEFAULT_METRIC
    assert settings["block_size"].default == DEFAULT_BLOCK_SIZE
    assert settings["dense_below"].default == DEFAULT_DENSE_BELOW
    assert settings["powersgd_rank"].default == DEFAULT_POWERSGD_RANK


def test_the_library_builds_what_convoy_train_builds():
    settings = settings_by_name()
    blocktopk, _ = build_compressor("blocktopk", block_fraction=0.01)
    assert (blocktopk.metric, blocktopk.block_size, blocktopk.dense_below) == (
        settings["block_metric"].default, settings["block_size"].default, settings["dense_below"].default)
    assert BlockTopKCompressor().metric == settings["block_metric"].default
    assert build_compressor("powersgd")[0].rank == PowerSGDCompressor().rank == settings["powersgd_rank"].default
    for name in ("topk", "randomk"):
        assert build_compressor(name)[0].fraction == settings["element_fraction"].default == DEFAULT_ELEMENT_FRACTION
    assert Compression("topk").fraction == Knobs().element_fraction == DEFAULT_ELEMENT_FRACTION


@pytest.mark.parametrize("flag, value", [("credit_kb", DEFAULT_CREDIT_KB), ("slice_kb", DEFAULT_SLICE_KB),
                                         ("channels", DEFAULT_CHANNELS)])
def test_ps_help_states_the_settings_own_default(flag, value):
    # The ps flags default to None (the priority mode decides); their help names the prioritised default.
    assert re.search(rf"\(default {value:g};", settings_by_name()[flag].help)


def test_ps_settings_resolve_to_the_defaults_the_help_states():
    resolved = PSSettings.resolve(servers=1, priority="graph")
    assert resolved.credit_bytes == DEFAULT_CREDIT_KB * 1024
    assert resolved.slice_bytes == DEFAULT_SLICE_KB * 1024
    assert resolved.channels == DEFAULT_CHANNELS


# Options the simulator defaults otherwise on purpose, and why.
SIMULATOR_OWN_DEFAULTS = {
    "model": "vgg_fc, whose large FC head makes the network matter, is the example a prediction is about",
    "clusters": "train's auto chooses K from the profiled nodes; the simulator has no profiles, so it takes a count",
}


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_simulator_defaults_are_convoy_trains(command):
    """Every option the simulator shares with convoy train (same dest) has train's default."""
    settings, checked = settings_by_name(), 0
    for dest, default in _defaults(command).items():
        if dest in SIMULATOR_OWN_DEFAULTS:
            continue
        if dest in settings and settings[dest].default is not None and default is not None:
            assert default == settings[dest].default, f"convoy {command} --{dest.replace('_', '-')}"
            checked += 1
    assert checked >= (5 if command == "simulate" else 1)
