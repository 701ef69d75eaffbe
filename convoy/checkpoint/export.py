"""Between convoy checkpoints and plain PyTorch files: export one, start from one.

``export_checkpoint`` writes what ``torch.load`` reads anywhere:
``{"model": state_dict, "optimizers": [per-layer optimizer state_dict, in
forward order], "step", "epoch"}`` (the layout of convoy's ``model.pt``).
``load_initial_state`` takes such a file, or a bare ``state_dict``, as a
starting point for training.

Example::

    >>> export_checkpoint("ckpt", "model.pt")
    >>> model.load_state_dict(torch.load("model.pt")["model"])
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.checkpoint.format import FormatError
from convoy.checkpoint.recovery import rank_file_tensors, scan, state_dict_of, valid_steps
from convoy.checkpoint.store import Store
from convoy.errors import UsageError
from convoy.utils.atomic import save_atomically


def _model_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise UsageError(f"checkpoint directory {directory} does not exist")
    files = sorted(directory.glob("model-rank*.ckpt"))
    if not files:
        raise UsageError(f"{directory} holds no convoy checkpoint (no model-rank*.ckpt)")
    return files


@dataclass
class _Part:
    """One model file's share of the newest step every file holds."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    states: dict[str, dict]
    order: list[str]
    hyper: dict[str, Any]
    step: int
    epoch: int


def export_checkpoint(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the newest valid checkpoint in ``directory`` as a plain torch file ``out``; return it.

    Every model file takes part: in hybrid parallelism each group wrote its own
    layers (under their names in the whole model), on several nodes each node
    wrote a copy. The step exported is the newest one valid in all of them.
    Buffers (batch-norm statistics) come from each writer's state file when it
    holds the same step.

    Raises:
        UsageError: no checkpoint, or no step is valid in every model file.
    """
    paths = _model_files(Path(directory))
    valid = {path: _valid_steps(path) for path in paths}
    common = set.intersection(*(set(steps) for steps in valid.values()))
    if not common:
        raise UsageError(f"no step of {directory} is valid in every model file: " + "; ".join(
            f"{path.name}: steps {sorted(steps) or 'none'}" for path, steps in valid.items()))
    parts = [_read_part(path, max(common)) for path in paths]
    model: dict[str, torch.Tensor] = {}
    optimizers, order = [], []
    for part in parts:
        model.update(part.params)
        model.update(part.buffers)
        for name in part.order:
            if name not in order:   # copies from other nodes repeat the same layers
                order.append(name)
                optimizers.append({"state": part.states[name], "param_groups": [
                    {**part.hyper, "params": list(range(_count_params(part.params, name)))}]})
    result = {"model": model, "optimizers": optimizers, "layers": order,
              "step": parts[0].step, "epoch": parts[0].epoch}
    save_atomically(result, out)
    return result


def _valid_steps(path: Path) -> list[int]:
    try:
        store = Store.open(path)
    except FormatError as exc:
        raise UsageError(f"{path} is not a usable checkpoint: {exc}") from None
    try:
        reports = scan(store)
        valid = valid_steps(reports)
        if not valid:
            raise UsageError(f"no valid area in {path}: " + "; ".join(r.describe() for r in reports))
        return list(valid)
    finally:
        store.close()


def _read_part(path: Path, step: int) -> _Part:
    store = Store.open(path)
    try:
        chosen = valid_steps(scan(store))[step]
        params, states = state_dict_of(store, chosen.area)
        record = chosen.record
    finally:
        store.close()
    writer = path.name[len("model-rank"):-len(".ckpt")]
    buffers = rank_file_tensors(path.parent / f"state-rank{writer}.ckpt", "buffer", step)
    names = record.extra.get("full_names")
    order = record.extra.get("forward_order") or list(states)
    if names:
        layers = {layer: _full_layer_name(layer, params, names) for layer in order}
        params = {names[k]: v for k, v in params.items()}
        buffers = {names.get(k, k): v for k, v in buffers.items()}
        states = {layers[layer]: state for layer, state in states.items()}
        order = [layers[layer] for layer in order]
    return _Part(params, buffers, states, order, record.extra.get("hyper", {}), record.step, record.epoch)


def _full_layer_name(layer: str, params: dict[str, torch.Tensor], names: dict[str, str]) -> str:
    """The whole model's name of a part's layer, from the full name of one of its tensors."""
    prefix = "" if layer == "<root>" else layer + "."
    key = next(k for k in params if k.startswith(prefix) and "." not in k[len(prefix):])
    full, own = names[key], key[len(prefix):]
    return full[:-len(own) - 1] if full != own else "<root>"


def _count_params(params: dict[str, torch.Tensor], layer: str) -> int:
    prefix = "" if layer == "<root>" else layer + "."
    return sum(1 for k in params if k.startswith(prefix) and "." not in k[len(prefix):])



def load_initial_state(model: nn.Module, path: str | Path) -> None:
    """Load parameters (and buffers) from a torch file: a ``state_dict`` or ``{"model": state_dict, ...}``.

    Raises:
        UsageError: the file cannot be read or does not fit ``model`` (names the first mismatch).
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # a file that is not torch's raises whatever the unpickler trips on
        reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        raise UsageError(f"--init-from {path}: cannot read it as a torch file ({reason})") from None
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise UsageError(f"--init-from {path}: expected a state_dict or {{'model': state_dict}}")
    own = model.state_dict()
    for key, tensor in own.items():
        if key not in state:
            raise UsageError(f"--init-from {path}: it has no {key!r}")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise UsageError(f"--init-from {path}: {key!r} has shape {tuple(state[key].shape)}, "
                             f"this model needs {tuple(tensor.shape)}")
    extra = sorted(set(state) - set(own))
    if extra:
        raise UsageError(f"--init-from {path}: {extra[0]!r} is not in this model")
    model.load_state_dict(state)
