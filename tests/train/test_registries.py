"""The ``--sync`` and ``--parallel`` registries: a strategy or layout registered at runtime is a choice
of ``convoy train`` (its help, its checks, the planner's list), a name is registered once, an unknown
name is refused in one line naming the choices, and a registered plug-in is what the job builds."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from convoy import runtime
from convoy.cli.main import build_parser
from convoy.cli.plan import train_choices
from convoy.errors import UsageError
from convoy.models import build_model
from convoy.train.builtins import allreduce_syncs, build_data
from convoy.train.config import TrainConfig
from convoy.train.elastic import mapping_of, resumable_jobs
from convoy.train.layouts import LAYOUTS, LayoutSpec
from convoy.train.loop import build_layout
from convoy.train.registry import Registry
from convoy.train.strategies import STRATEGIES, StrategySpec
from tests.helpers import convoy_in_process, one_line_error, run_workers


@dataclass(frozen=True)
class Case:
    registry: Registry
    toy: Any            # a spec built from the built-ins' own parts, under a name of its own
    setting: str        # its flat name (``sync``: ``--sync``)
    help: str           # the flag's help up to its choices
    builtins: tuple[str, ...]


CASES = {
    "sync": Case(STRATEGIES, StrategySpec("toy-sync", syncs=allreduce_syncs), "sync",
                 "gradient synchronisation strategy:", ("allreduce", "hierarchical", "ps")),
    "parallel": Case(LAYOUTS, LayoutSpec("toy-layout", build_data), "parallel", "parallel layout:",
                     ("data", "hybrid")),
}


def _register_toys() -> None:
    for case in CASES.values():
        if case.toy.name not in case.registry.names():   # a worker forked after a fixture registered it has it
            case.registry.register(case.toy)


@pytest.fixture(params=sorted(CASES))
def case(request):
    case = CASES[request.param]
    case.registry.register(case.toy)
    yield case
    case.registry.unregister(case.toy.name)


def _help_of(flag: str) -> str:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (action,) = [a for a in commands.choices["train"]._actions if flag in a.option_strings]
    return action.help


def test_the_builtins_keep_their_names_and_order():
    for case in CASES.values():
        assert case.registry.names() == case.builtins
        assert _help_of(f"--{case.setting}").startswith(f"{case.help} {', '.join(case.builtins)}")


def test_a_registered_toy_is_a_choice_of_convoy_train_help_and_of_the_planner(case):
    names = ", ".join((*case.builtins, case.toy.name))
    assert _help_of(f"--{case.setting}").startswith(f"{case.help} {names}")
    shown = convoy_in_process("train", "--help")
    assert shown.returncode == 0, shown.stderr
    assert f"{case.help} {names}" in " ".join(shown.stdout.split())   # as printed, lines unwrapped
    assert train_choices()[f"--{case.setting}"] == (*case.builtins, case.toy.name)
    assert TrainConfig.from_flat(**{case.setting: case.toy.name}).validate()


def test_a_name_is_registered_once(case):
    with pytest.raises(ValueError, match=f"--{case.setting} '{case.toy.name}' is already registered"):
        case.registry.register(case.toy)
    for name in case.builtins:
        with pytest.raises(ValueError, match="already registered"):
            case.registry.register(replace(case.toy, name=name))
    assert case.registry.names() == (*case.builtins, case.toy.name)


def test_an_unknown_name_is_one_line_naming_the_choices_exit_2(case):
    line = one_line_error(convoy_in_process("train", f"--{case.setting}", "zip"))
    assert f"unknown --{case.setting} 'zip'; choose one of: {', '.join((*case.builtins, case.toy.name))}" in line
    case.registry.unregister(case.toy.name)
    try:
        line = one_line_error(convoy_in_process("train", f"--{case.setting}", case.toy.name))
        assert f"choose one of: {', '.join(case.builtins)}" in line
        with pytest.raises(UsageError, match=f"unknown --{case.setting} '{case.toy.name}'"):
            case.registry.spec(case.toy.name)
    finally:
        case.registry.register(case.toy)   # for the fixture's teardown


def test_a_strategy_runs_in_the_engines_or_lays_out_the_job_never_both_nor_neither():
    for given in ({}, {"syncs": allreduce_syncs, "layouts": {"data": build_data}}):
        with pytest.raises(ValueError, match="one of them"):
            StrategySpec("half", **given)


def test_a_plugin_resumes_only_on_its_world_and_the_message_names_those_that_resume_anywhere(case):
    assert mapping_of(TrainConfig.from_flat(**{case.setting: case.toy.name})) is None
    assert resumable_jobs() == ("--sync allreduce, hierarchical or ps with --parallel data, and --parallel hybrid with "
                            "--sync allreduce")


def _trained(rank: int, world: int, sync: str, parallel: str) -> torch.Tensor:
    _register_toys()   # this worker's own registries (a plug-in registers in every process that uses it)
    ctx = runtime.init("gloo")
    config = TrainConfig.from_flat(sync=sync, parallel=parallel, batch_size=4, steps=3, lr=0.1).validate()
    torch.manual_seed(0)
    model = build_model("lenet", in_channels=1, num_classes=10, image_size=(28, 28))
    layout = build_layout(config, model, ctx, 3, (1, 28, 28))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        layout.train_step(torch.randn(4, 1, 28, 28, generator=generator), torch.randint(0, 10, (4,),
                                                                                      generator=generator))
    layout.engine.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.timeout(120)
def test_registered_plugins_are_what_the_job_builds_and_train_as_the_builtins_they_reuse():
    builtin = run_workers(_trained, 2, "allreduce", "data")
    toys = run_workers(_trained, 2, CASES["sync"].toy.name, CASES["parallel"].toy.name)
    for mine, theirs in zip(toys, builtin):
        assert torch.equal(mine, theirs)
    assert torch.equal(toys[0], toys[1]) and not torch.equal(toys[0], _untrained())


def _untrained() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in build_model("lenet", image_size=(28, 28)).parameters()])
