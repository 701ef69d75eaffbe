"""Per-layer sizes and compute times of a model: measured with hooks, or read from a file.

A layer is a module that owns parameters (the engine's unit), in forward order.
Its forward time runs from its forward pre-hook to the next layer's (so the
ReLU and pooling after a conv count as that conv's); its backward time is how
long after the previous gradient (in backward order) its own gradient is ready,
which is exactly when the engine's auxiliary thread may start exchanging it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from convoy.engine.layers import ForwardOrderRecorder
from convoy.errors import UsageError


@dataclass(frozen=True)
class LayerProfile:
    """One parameter-owning layer.

    Args:
        name: the module's name in the model.
        shapes: its parameters' shapes (they fix sizes, blocks and PowerSGD factors).
        forward_s, backward_s, update_s: seconds for one worker's batch.
        head: True for the fully-connected head (hybrid's FC workers train it).

    Example::

        >>> LayerProfile("fc", ((10, 84), (10,)), 1e-4, 2e-4, 1e-5, head=True).params
        850
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]
    forward_s: float
    backward_s: float
    update_s: float = 0.0
    head: bool = False

    @property
    def params(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return 4 * self.params  # fp32 gradients and parameters


@dataclass(frozen=True)
class ModelProfile:
    """A model's layers in forward order, for one worker's batch of ``batch_size``.

    Args:
        name: the model's name.
        layers: per-layer sizes and times, forward order.
        batch_size: samples the times are for.
        activation_bytes: bytes per sample of the activations at the conv/FC
            boundary (what hybrid sends over its link; 0 if unknown).
        source: where the times come from (a machine, a file, a paper).
    """

    name: str
    layers: tuple[LayerProfile, ...]
    batch_size: int
    activation_bytes: int = 0
    source: str = ""

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """Forward, backward and update of every layer: a step with free communication."""
        return sum(l.forward_s + l.backward_s + l.update_s for l in self.layers)

    def scaled(self, factor: float) -> "ModelProfile":
        """The same model on a machine ``factor`` times slower (factor < 1: faster)."""
        layers = tuple(LayerProfile(l.name, l.shapes, l.forward_s * factor, l.backward_s * factor,
                                    l.update_s * factor, l.head) for l in self.layers)
        return ModelProfile(self.name, layers, self.batch_size, self.activation_bytes, self.source)

    def at_batch(self, batch_size: int) -> "ModelProfile":
        """The same model at another batch per worker: forward and backward scale with the batch."""
        if batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}")
        r = batch_size / self.batch_size
        layers = tuple(LayerProfile(l.name, l.shapes, l.forward_s * r, l.backward_s * r, l.update_s, l.head)
                       for l in self.layers)
        return ModelProfile(self.name, layers, batch_size, self.activation_bytes, self.source)

    def split(self) -> tuple["ModelProfile", "ModelProfile"]:
        """``(conv part, FC head)`` for hybrid parallelism."""
        conv = tuple(l for l in self.layers if not l.head)
        head = tuple(l for l in self.layers if l.head)
        if not conv or not head:
            raise UsageError(f"model {self.name} has no conv/FC boundary for hybrid parallelism")
        return (ModelProfile(self.name, conv, self.batch_size, self.activation_bytes, self.source),
                ModelProfile(self.name, head, self.batch_size, self.activation_bytes, self.source))

    def to_json(self) -> dict:
        return asdict(self)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile written by :meth:`ModelProfile.to_json` (or by hand, same keys).

    Example file::

        {"name": "mynet", "batch_size": 32, "layers": [
          {"name": "conv1", "shapes": [[64, 3, 3, 3], [64]], "forward_s": 0.002, "backward_s": 0.004}]}
    """
    try:
        data = json.loads(Path(path).read_text())
        layers = tuple(LayerProfile(str(l["name"]), tuple(tuple(int(d) for d in s) for s in l["shapes"]),
                                    float(l["forward_s"]), float(l["backward_s"]), float(l.get("update_s", 0.0)),
                                    bool(l.get("head", False))) for l in data["layers"])
        profile = ModelProfile(str(data.get("name", Path(path).stem)), layers, int(data.get("batch_size", 1)),
                               int(data.get("activation_bytes", 0)), str(data.get("source", str(path))))
    except FileNotFoundError:
        raise UsageError(f"profile file {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"cannot read model profile {path}: {exc}") from None
    if not layers or any(min(l.forward_s, l.backward_s, l.update_s) < 0 for l in layers):
        raise UsageError(f"model profile {path} needs layers with non-negative times")
    return profile


@dataclass
class _Marks:
    """Timestamps of one training step, per layer."""

    forward: dict[int, float] = field(default_factory=dict)
    ready: dict[int, float] = field(default_factory=dict)


def profile_model(name: str, batch_size: int = 16, repeats: int = 5, in_channels: int = 1,
                  num_classes: int = 10, image_size: tuple[int, int] = (32, 32)) -> ModelProfile:
    """Measure a built-in (or ``package.module:factory``) model on this machine, one torch thread.

    The fastest of ``repeats`` steps per layer, after two warm-up steps. One thread, as
    ``convoy train --threads 1`` runs each worker.

    Example::

        >>> p = profile_model("lenet", batch_size=16, repeats=3)
        >>> p.layers[0].name, p.params
        ('features.0', 82826)
    """
    from convoy.models import build_model
    from convoy.models.split import split_point

    if batch_size < 1 or repeats < 1:
        raise UsageError("profiling needs batch_size >= 1 and repeats >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_model(name, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
        x = torch.randn(batch_size, in_channels, *image_size)
        y = torch.randint(0, num_classes, (batch_size,))
        recorder = ForwardOrderRecorder(model)
        model(x)
        layers = recorder.finish()
        head_params = _head_params(model, split_point)
        activation_bytes = _boundary_bytes(model, split_point, x)
        optimizers = [torch.optim.SGD(l.params, lr=0.01, momentum=0.9, weight_decay=5e-4) for l in layers]
        samples = [_one_step(model, layers, optimizers, x, y) for _ in range(repeats + 2)][2:]
    finally:
        torch.set_num_threads(threads)
    out = []
    for i, layer in enumerate(layers):
        # The fastest of the repeats: interference (other jobs on a shared machine) only adds time.
        best = [min(s[k][i] for s in samples) for k in range(3)]
        out.append(LayerProfile(layer.name, tuple(tuple(p.shape) for p in layer.params), *best,
                                head=all(id(p) in head_params for p in layer.params)))
    return ModelProfile(name, tuple(out), batch_size, activation_bytes, source=f"measured, batch {batch_size}")


def _head_params(model: nn.Module, split_point) -> set[int]:
    try:
        return {id(p) for p in split_point(model)[1].parameters()}
    except UsageError:
        return set()


def _boundary_bytes(model: nn.Module, split_point, x: torch.Tensor) -> int:
    try:
        features = split_point(model)[0]
    except UsageError:
        return 0
    with torch.no_grad():
        out = features(x[:1])
    return out.numel() * out.element_size()


def _stamp(marks: dict[int, float], index: int, first: bool):
    """A hook that records the time under ``index`` (the first call's, or the last's); returns None."""
    def hook(*args) -> None:
        if not (first and index in marks):
            marks[index] = time.perf_counter()
    return hook


def _one_step(model: nn.Module, layers, optimizers, x, y) -> tuple[list[float], list[float], list[float]]:
    """Per-layer forward, backward and update seconds of one step."""
    marks = _Marks()
    handles = []
    for layer in layers:
        handles.append(layer.module.register_forward_pre_hook(_stamp(marks.forward, layer.index, first=True)))
        for p in layer.params:
            handles.append(p.register_post_accumulate_grad_hook(_stamp(marks.ready, layer.index, first=False)))
    try:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        backward_start = time.perf_counter()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    n = len(layers)
    fwd_marks = [marks.forward.get(i, start) for i in range(n)] + [backward_start]
    forward = [max(0.0, fwd_marks[i + 1] - fwd_marks[i]) for i in range(n)]
    forward[0] += fwd_marks[0] - start
    # Backward runs in reverse; a layer's share is its gradient's delay after
    # the latest gradient of a later layer (residual nets reorder a little).
    backward, latest = [0.0] * n, backward_start
    for i in reversed(range(n)):
        ready = marks.ready.get(i, latest)
        backward[i] = max(0.0, ready - latest)
        latest = max(latest, ready)
    update = []
    for opt in optimizers:
        t0 = time.perf_counter()
        opt.step()
        update.append(time.perf_counter() - t0)
    return forward, backward, update
