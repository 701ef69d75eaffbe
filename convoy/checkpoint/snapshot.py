"""What a checkpoint holds, and where each tensor of the model and the optimizers comes from.

The model file has one slot per layer (a module that owns trainable
parameters): its parameters (``param.<name>``) and its optimizer's tensor
state (``optim.<i>.<key>``, ``i`` the parameter's position in the layer). The
layout is known before training: a throw-away optimizer takes one step on
zero copies of each layer to reveal the shapes and dtypes of its state.

A rank file has one slot of per-rank state: buffers (batch-norm statistics
differ between ranks), the sync strategy's state (error-feedback residuals,
a compressor's factors: ``SyncStrategy.state_tensors``) and the RNG.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from convoy.checkpoint.format import Layout, Slot, TensorSpec
from convoy.core import SyncStrategy
from convoy.engine.layers import parameter_modules

ROOT = "<root>"   # the name the engine gives a model that owns parameters itself


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The model's layers as the engine names them (registration order)."""
    return [(name or ROOT, module, params) for name, module, params in parameter_modules(model)]


def _param_names(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def _probe_state(params: list[nn.Parameter], optimizer_class: type, kwargs: dict) -> list[dict]:
    """The optimizer state each parameter has after one step (on zero copies: the model is untouched)."""
    copies = [torch.zeros_like(p, requires_grad=True) for p in params]
    optimizer = optimizer_class(copies, **kwargs)
    for c in copies:
        c.grad = torch.zeros_like(c)
    optimizer.step()
    return [optimizer.state.get(c, {}) for c in copies]


def model_layout(model: nn.Module, optimizer_class: type, optimizer_kwargs: dict[str, Any]) -> Layout:
    """The model file's layout: one slot per layer with its parameters and optimizer state.

    Example::

        >>> layout = model_layout(lenet(), torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
        >>> [t.key for t in layout.slots[0].tensors]
        ['param.weight', 'param.bias', 'optim.0.momentum_buffer', 'optim.1.momentum_buffer']
    """
    slots = []
    for name, module, params in model_layers(model):
        specs = [TensorSpec.of(f"param.{n}", p) for n, p in zip(_param_names(module), params)]
        for i, state in enumerate(_probe_state(params, optimizer_class, optimizer_kwargs)):
            specs += [TensorSpec.of(f"optim.{i}.{k}", v) for k, v in sorted(state.items())
                      if isinstance(v, torch.Tensor)]
        slots.append(Slot(name, specs))
    return Layout("model", slots, {"optimizer": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"})


def layer_sources(module: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                  slot: Slot) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The live tensors of ``slot`` in layout order, and the optimizer's non-tensor state values."""
    return slot_sources(module, params, {i: optimizer.state.get(p, {}) for i, p in enumerate(params)}, slot)


def slot_sources(module: nn.Module, params: list[nn.Parameter], state: dict[int, dict[str, Any]],
                 slot: Slot) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """As :func:`layer_sources`, from a layer optimizer's ``state`` by parameter position (its
    ``state_dict()["state"]``, as :func:`convoy.checkpoint.recovery.replay_updates` returns it)."""
    named = dict(zip(_param_names(module), params))
    tensors, meta = [], {}
    for spec in slot.tensors:
        kind, rest = spec.key.split(".", 1)
        if kind == "param":
            tensors.append(named[rest].detach())
        else:
            index, key = rest.split(".", 1)
            tensors.append(state[int(index)][key])
    for i in range(len(params)):
        for key, value in state.get(i, {}).items():
            if not isinstance(value, torch.Tensor):
                meta[f"{i}.{key}"] = value
    return tensors, meta


def optimizer_state(slot_tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A per-layer optimizer's ``state`` (``state_dict()["state"]``) from a slot's tensors and meta."""
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in slot_tensors.items():
        if key.startswith("optim."):
            index, name = key[len("optim."):].split(".", 1)
            state.setdefault(int(index), {})[name] = tensor.clone()
    for key, value in meta.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return state


def restore_parameters(module: nn.Module, slot_tensors: dict[str, torch.Tensor]) -> None:
    """Copy the slot's ``param.*`` tensors into the module's parameters (bit for bit)."""
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                param.copy_(slot_tensors[f"param.{name}"])


def rank_state(model: nn.Module, sync: SyncStrategy, buffers: dict[str, torch.Tensor] | None = None,
               scaler: Any = None) -> dict[str, torch.Tensor]:
    """Copies of this rank's own state: buffers, the sync strategy's state, the torch RNG,
    and the fp16 loss scale.

    Args:
        buffers: buffer copies already taken (when their layer was final); the
            model's other buffers are copied now.
        scaler: the engine's fp16 loss scaler, if any (``Engine.loss_scaler``).
    """
    out = {f"buffer.{k}": v for k, v in (buffers or {}).items()}
    for name, buf in model.named_buffers():
        out.setdefault(f"buffer.{name}", buf.detach().clone())
    replaced = sync.replaced_each_step()
    for key, value in sync.state_tensors().items():
        # A tensor the memory replaces every step is a snapshot as it is: no copy on the training path.
        out[f"sync.{key}"] = value.detach() if key.split(".", 1)[0] in replaced else value.detach().clone()
    out["rng.torch"] = torch.get_rng_state()
    if scaler is not None:
        out.update({f"scaler.{key}": value for key, value in scaler.state_tensors().items()})
    return out


def module_buffers(prefix: str, module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``(model-level name, buffer)`` for the buffers a layer module owns itself."""
    base = "" if prefix == ROOT else prefix + "."
    return ((base + n, b) for n, b in module.named_buffers(recurse=False))


def rank_layout(state: dict[str, torch.Tensor], info: dict[str, Any]) -> Layout:
    return Layout("rank", [Slot("state", [TensorSpec.of(k, v) for k, v in state.items()])], info)


def restore_rank_state(model: nn.Module, sync: SyncStrategy, tensors: dict[str, torch.Tensor],
                       scaler: Any = None) -> None:
    """Put buffers, the sync strategy's state, the RNG state and the loss scale back from a rank slot's tensors."""
    buffers = dict(model.named_buffers())
    # The sync's state (residuals, warm starts) goes back where the model trains: a GPU's is read to the CPU.
    device = next(model.parameters(), torch.empty(0)).device
    sync_state, scaler_state = {}, {}
    with torch.no_grad():
        for key, tensor in tensors.items():
            kind, name = key.split(".", 1)
            if kind == "buffer" and name in buffers:
                buffers[name].copy_(tensor)
            elif kind == "sync":
                sync_state[name] = tensor.to(device)
            elif key == "rng.torch":
                torch.set_rng_state(tensor.clone())
            elif kind == "scaler":
                scaler_state[name] = tensor
    sync.load_state_tensors(sync_state)
    if scaler is not None:
        scaler.load_state_tensors(scaler_state)
