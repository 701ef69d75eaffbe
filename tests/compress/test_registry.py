"""The compressor registry: a compressor defined here, registered at runtime, is usable everywhere
that names compressors, and everything that lists them lists the registry's names."""
from __future__ import annotations

import argparse
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import convoy
from bench.ddp_hook_stress import stress_net
from convoy.cli.main import build_parser
from convoy.cli.plan import train_choices
from convoy.compress import (Compressor, CompressorSpec, IdentityCompressor, LayerInfo, Memory, NoMemory,
                             build_compressor, compressor_names, compressor_spec, momentum_corrected_names,
                             register, sparse_names, unregister)
from convoy.ddp import CompressedHookState, compressed_hook, hook_names
from convoy.errors import UsageError
from convoy.sim.codec import Compression
from convoy.train.sections import CompressConfig
from tests.helpers import run_workers

PLUGIN = "scaled-plugin"


class ScaledCompressor(Compressor):
    """A plug-in: sends the gradient times ``scale`` (a power of two, so exactly) and divides it back."""

    summable = True

    def __init__(self, scale: float = 2.0):
        self.scale = scale

    def compress(self, tensor: torch.Tensor, name: str, info: LayerInfo | None = None) -> tuple[list, Any]:
        return [tensor * self.scale], None

    def decompress(self, payload: list, ctx: Any) -> torch.Tensor:
        return payload[0] / self.scale


def _build(scale: float = 2.0) -> tuple[Compressor, Memory]:
    return ScaledCompressor(scale), NoMemory()


def _register_plugin() -> None:
    if PLUGIN not in compressor_names():   # a worker forked after the fixture registered it has it already
        register(CompressorSpec(PLUGIN, _build, options=("scale",), hook_options={"scale": "scale"}))


@pytest.fixture
def plugin():
    _register_plugin()
    yield PLUGIN
    unregister(PLUGIN)


def test_a_registered_plugin_is_built_by_name(plugin):
    compressor, memory = build_compressor(plugin, scale=8.0, element_fraction=0.5)  # others' options ignored
    assert isinstance(compressor, ScaledCompressor) and compressor.scale == 8.0 and isinstance(memory, NoMemory)
    assert compressor_names()[-1] == plugin and plugin in hook_names()
    assert plugin not in sparse_names() and plugin not in momentum_corrected_names()
    with pytest.raises(TypeError, match="zoom"):
        build_compressor(plugin, zoom=2.0)


def test_a_plugin_passes_the_train_configs_check_and_leaves_with_unregister(plugin):
    assert CompressConfig(name=plugin).validate().name == plugin
    with pytest.raises(UsageError, match=f"the simulator has no model of compressor '{plugin}'"):
        Compression(plugin)
    unregister(plugin)
    with pytest.raises(UsageError, match=f"unknown --compress '{plugin}'"):
        CompressConfig(name=plugin).validate()
    with pytest.raises(UsageError, match=f"unknown comm hook '{plugin}'"):
        convoy.ddp.comm_hook(plugin)
    _register_plugin()   # for the fixture's teardown


def test_register_refuses_a_taken_name_and_hook_options_it_does_not_take():
    with pytest.raises(ValueError, match="already registered"):
        register(CompressorSpec("topk", _build))
    with pytest.raises(ValueError, match="unknown options"):
        register(CompressorSpec("other-plugin", _build, options=("scale",), hook_options={"rank": "rank"}))
    assert "other-plugin" not in compressor_names()


def test_the_builtins_keep_their_names_order_and_kinds():
    assert compressor_names() == ("none", "fp16", "blocktopk", "topk", "randomk", "powersgd")
    assert sparse_names() == ("blocktopk", "topk", "randomk")
    assert set(momentum_corrected_names()) == {"fp16", "blocktopk", "topk", "randomk", "powersgd"}
    assert hook_names() == ("fp16", "blocktopk", "topk", "powersgd", "torch-powersgd")
    assert compressor_spec("powersgd").hook_options == {"rank": "powersgd_rank"}


def test_the_clis_compress_choices_are_the_registry(plugin):
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (flag,) = [a for a in commands.choices["train"]._actions if "--compress" in a.option_strings]
    # The help was written when convoy.compress was imported: the built-ins, in order.
    builtins = ", ".join(name for name in compressor_names() if name != plugin)
    assert flag.help == f"gradient compressor: {builtins} (default: none)"
    assert train_choices()["--compress"] == compressor_names()
    for name in compressor_names():
        assert CompressConfig(name=name).validate().name == name
    with pytest.raises(UsageError, match="choose one of: " + ", ".join(compressor_names())):
        CompressConfig(name="zip").validate()


def _hooked(rank: int, world: int) -> dict[str, torch.Tensor]:
    _register_plugin()   # this worker's own registry (a plug-in registers in every process that uses it)
    out = {}
    for label, pair in (("plugin", convoy.ddp.comm_hook(PLUGIN, scale=4.0)),
                        ("identity", (CompressedHookState(IdentityCompressor(), NoMemory()), compressed_hook))):
        torch.manual_seed(0)
        model = DistributedDataParallel(stress_net())
        model.register_comm_hook(*pair)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(8, 1, 16, 16, generator=generator)),
                            torch.randint(0, 10, (8,), generator=generator)).backward()
            optimizer.step()
        out[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del model, optimizer   # while the process group lives (see tests/ddp/test_ddp_hook.py)
        gc.collect()
    return out


@pytest.mark.timeout(120)
def test_a_plugin_runs_as_a_ddp_comm_hook(plugin):
    results = run_workers(_hooked, 2)
    # Scaling by 4 and back is exact, so the plug-in's hook trains exactly as the identity's.
    for result in results:
        assert torch.equal(result["plugin"], result["identity"])
    assert torch.equal(results[0]["plugin"], results[1]["plugin"])
