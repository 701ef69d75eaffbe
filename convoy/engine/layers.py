"""Layers: the parameter-owning modules of a model, in the order forward uses them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from convoy.compress import Support


@dataclass(eq=False)
class Layer:
    """One parameter-owning module and its trainable parameters.

    ``index`` is the module's position in forward order; every rank computes
    the same order, so it doubles as the layer's identity in collectives.
    """

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


@dataclass(eq=False)
class Bucket:
    """Consecutive layers (in sync order) exchanged as one payload.

    One collective for several small layers saves the per-message latency
    that dominates small exchanges; each layer is still updated on its own as
    soon as the bucket's exchange ends. ``index`` is the bucket's position in
    sync order, the same on every rank.
    """

    index: int
    layers: list[Layer]
    _buffer: torch.Tensor | None = field(default=None, repr=False)  # backs every p.grad
    _views: list[tuple[nn.Parameter, int, int, int]] = field(default_factory=list, repr=False)
    # Where this step's averaged gradient may be non-zero, when the exchange knew (see set_grads).
    support: Support | None = field(default=None, repr=False)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def name(self) -> str:
        return "+".join(layer.name for layer in self.layers)

    def attach_grads(self) -> None:
        """Make every ``p.grad`` a view into one flat buffer of the bucket.

        Backward then accumulates straight into the buffer the exchange sends
        (DDP's ``gradient_as_bucket_view``): no copy, and no fresh multi-MB
        gradient allocation, with its page faults, every step.
        """
        params = self.params
        self._buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                   device=params[0].device)
        offset = 0
        self._views = []
        for p in params:
            view = self._buffer[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self._views.append((p, offset, p.numel(), view.data_ptr()))
            offset += p.numel()

    def flat_grad(self) -> torch.Tensor:
        """This step's gradients, flat (the bucket's buffer, valid until ``reset_grads``)."""
        assert self._buffer is not None, "attach_grads first"
        # Addresses kept from attach_grads: no slice tensors made per parameter and step.
        for p, offset, numel, address in self._views:
            # Someone (a user's zero_grad(set_to_none=True)) replaced the view.
            if p.grad is None or p.grad.data_ptr() != address:
                self._buffer[offset:offset + numel].copy_(
                    p.grad.reshape(-1) if p.grad is not None else self._buffer.new_zeros(numel))
                p.grad = self._buffer[offset:offset + numel].view_as(p)
        return self._buffer

    def set_grads(self, flat: torch.Tensor, support: Support | None = None) -> None:
        """Point ``p.grad`` at the averaged gradient ``flat`` for the optimizer step; ``support``:
        where ``flat`` may be non-zero (kept until :meth:`reset_grads`; scaling the gradient in
        place keeps it true)."""
        self.support = support
        if flat.data_ptr() == self._buffer.data_ptr():
            return
        self._buffer.copy_(flat)

    def set_params(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (the bucket's parameters, concatenated) into the parameters (a server's update)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def reset_grads(self) -> None:
        """Zero the buffer so the next backward accumulates this step's gradient afresh."""
        self.support = None
        self._buffer.zero_()


def make_buckets(layers: list[Layer], bucket_bytes: int) -> list[Bucket]:
    """Group ``layers``, taken in reverse forward order, into buckets of at least ``bucket_bytes``.

    ``bucket_bytes = 0`` gives one bucket per layer (pure layer-wise sync).
    """
    buckets: list[Bucket] = []
    current: list[Layer] = []
    for layer in reversed(layers):
        current.append(layer)
        if sum(l.nbytes for l in current) >= bucket_bytes:
            buckets.append(Bucket(len(buckets), current))
            current = []
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets


def parameter_modules(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Modules that directly own trainable parameters, in registration order."""
    found = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            found.append((name, module, params))
    return found


class ForwardOrderRecorder:
    """Records the order in which parameter-owning modules run in one forward pass.

    Registration order is not forward order (a ResNet's shortcut is registered
    after the block's convolutions but may run before them), so the order is
    observed, once, with forward pre-hooks.
    """

    def __init__(self, model: nn.Module):
        self._candidates = parameter_modules(model)
        self._seen: list[int] = []
        self._handles = [module.register_forward_pre_hook(self._make_hook(i))
                         for i, (_, module, _) in enumerate(self._candidates)]

    def _make_hook(self, i: int):
        def hook(module, args):
            if i not in self._seen:
                self._seen.append(i)
        return hook

    def finish(self) -> list[Layer]:
        """Remove the hooks and return the layers in forward order.

        Modules that never ran in forward (their parameters are used by a parent
        directly) go first, so the first forward hook waits for them too.
        """
        for handle in self._handles:
            handle.remove()
        unseen = [i for i in range(len(self._candidates)) if i not in self._seen]
        order = unseen + self._seen
        return [Layer(index=pos, name=self._candidates[i][0] or "<root>",
                      module=self._candidates[i][1], params=self._candidates[i][2])
                for pos, i in enumerate(order)]
