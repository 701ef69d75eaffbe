"""One optimizer per bucket, seen layer by layer.

A bucket's layers are updated by one optimizer call, so torch's multi-tensor
(``foreach``) kernels update all of them at once instead of one Python-level
step per layer. Checkpoints and resumption still speak per layer: each layer
gets a :class:`LayerOptimizer`, a view of its share of the bucket's optimizer
with the per-layer ``state_dict`` a dedicated optimizer would have.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def bucket_optimizer(optimizer_class: type[torch.optim.Optimizer], params: list[nn.Parameter],
                     kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer_class`` over ``params``, with ``foreach=True`` unless the caller chose.

    On CPU torch picks the per-tensor loop by default; the multi-tensor kernels
    run the same arithmetic per tensor with one call for the whole bucket.

    Example::

        >>> opt = bucket_optimizer(torch.optim.SGD, [nn.Parameter(torch.ones(2))], {"lr": 0.1})
        >>> opt.defaults["foreach"]
        True
    """
    if "foreach" in inspect.signature(optimizer_class.__init__).parameters:
        kwargs = {"foreach": True, **kwargs}
    return optimizer_class(params, **kwargs)


class LayerOptimizer:
    """One layer's share of its bucket's optimizer, with a per-layer optimizer's interface.

    ``state`` is the bucket optimizer's state (keyed by parameter, so indexing
    it with this layer's parameters gives this layer's state); ``state_dict``
    numbers the layer's parameters from 0, as an optimizer built on the layer
    alone would, so saved per-layer states load into either.

    Args:
        optimizer: the bucket's optimizer; it owns every parameter of ``params``.
        params: the layer's parameters, in the layer's order.

    Example::

        >>> p = nn.Parameter(torch.ones(2))
        >>> view = LayerOptimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9), [p])
        >>> view.state_dict()["param_groups"][0]["params"]
        [0]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        self.optimizer = optimizer
        self.params = list(params)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The bucket's groups, each restricted to this layer's parameters (a fresh list)."""
        mine = {id(p) for p in self.params}
        return [{**group, "params": [p for p in group["params"] if id(p) in mine]}
                for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {i: state of params[i]}, "param_groups": [...]}``, indices local to the layer."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(p)] for p in group["params"]]}
                  for group in self.param_groups]
        state = {i: dict(self.optimizer.state[p]) for i, p in enumerate(self.params) if p in self.optimizer.state}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the ``state`` part of a per-layer ``state_dict``; hyper-parameters stay as configured."""
        for i, values in state_dict["state"].items():
            param = self.params[int(i)]
            self.optimizer.state[param] = {key: _like(param, key, value) for key, value in values.items()}

    def step(self) -> None:
        raise RuntimeError("a layer's update runs with its bucket's optimizer; call the engine")


def _like(param: torch.Tensor, key: str, value: Any) -> Any:
    """A private copy of a state value, cast the way ``Optimizer.load_state_dict`` casts it."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step" or not value.is_floating_point():
        return value.detach().clone()
    return value.detach().to(device=param.device, dtype=param.dtype, copy=True)
