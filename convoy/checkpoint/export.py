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

from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.checkpoint.format import FormatError
from convoy.checkpoint.recovery import scan, state_dict_of, valid_steps
from convoy.checkpoint.store import Store
from convoy.errors import UsageError


def _model_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise UsageError(f"checkpoint directory {directory} does not exist")
    files = sorted(directory.glob("model-rank*.ckpt"))
    if not files:
        raise UsageError(f"{directory} holds no convoy checkpoint (no model-rank*.ckpt)")
    return files


def export_checkpoint(directory: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the newest valid checkpoint in ``directory`` as a plain torch file ``out``; return it.

    Buffers (batch-norm statistics) come from rank 0's state file when it holds the same step.

    Raises:
        UsageError: no checkpoint, or none of its areas is valid.
    """
    path = _model_files(Path(directory))[0]
    try:
        store = Store.open(path)
    except FormatError as exc:
        raise UsageError(f"{path} is not a usable checkpoint: {exc}") from None
    try:
        reports = scan(store)
        valid = valid_steps(reports)
        if not valid:
            raise UsageError(f"no valid area in {path}: " + "; ".join(r.describe() for r in reports))
        chosen = valid[max(valid)]
        params, states = state_dict_of(store, chosen.area)
        record = chosen.record
    finally:
        store.close()
    model = {**params, **_rank0_buffers(Path(directory), record.step)}
    hyper = record.extra.get("hyper", {})
    order = record.extra.get("forward_order") or list(states)
    optimizers = [{"state": states[name],
                   "param_groups": [{**hyper, "params": list(range(_count_params(params, name)))}]}
                  for name in order]
    result = {"model": model, "optimizers": optimizers, "layers": order,
              "step": record.step, "epoch": record.epoch}
    torch.save(result, out)
    return result


def _count_params(params: dict[str, torch.Tensor], layer: str) -> int:
    prefix = "" if layer == "<root>" else layer + "."
    return sum(1 for k in params if k.startswith(prefix) and "." not in k[len(prefix):])


def _rank0_buffers(directory: Path, step: int) -> dict[str, torch.Tensor]:
    path = directory / "state-rank0.ckpt"
    if not path.exists():
        return {}
    try:
        store = Store.open(path)
    except FormatError:
        return {}
    try:
        report = valid_steps(scan(store)).get(step)
        if report is None:
            return {}
        tensors = store.tensors(report.area, 0)
        out = {k[len("buffer."):]: v.clone() for k, v in tensors.items() if k.startswith("buffer.")}
        del tensors
        return out
    finally:
        store.close()


def load_initial_state(model: nn.Module, path: str | Path) -> None:
    """Load parameters (and buffers) from a torch file: a ``state_dict`` or ``{"model": state_dict, ...}``.

    Raises:
        UsageError: the file cannot be read or does not fit ``model`` (names the first mismatch).
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise UsageError(f"--init-from {path}: cannot read it as a torch file ({exc})") from None
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
