"""The forward pass as a graph of operations, traced once, with measured run times.

torch.fx gives the operations and their data dependencies where the model is
symbolically traceable; otherwise forward hooks record the modules in the
order they ran, each depending on the one before. Either way every operation
lists the layers (parameter-owning modules) whose parameters it reads: those
parameters are what a worker must receive before it can run the operation.
Tracing runs on a copy of the model, so batch-norm statistics stay untouched.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_REPEATS = 3   # timed forward passes after one warm-up; the fastest is kept


@dataclass
class Op:
    """One operation of the forward pass.

    ``inputs`` are indices of the operations whose outputs it reads; ``layers``
    the indices of the layers whose parameters it reads; ``time_s`` its
    measured run time.
    """

    name: str
    inputs: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    time_s: float = 0.0


@dataclass
class OpGraph:
    """The operations of one forward pass in execution order (a topological order)."""

    ops: list[Op]
    layer_names: list[str]
    layer_bytes: list[int]
    method: str   # "fx" or "hooks"

    def consumers(self, layer: int) -> list[int]:
        """Indices of the operations that read ``layer``'s parameters."""
        return [i for i, op in enumerate(self.ops) if layer in op.layers]


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Modules that own trainable parameters directly, in registration order.

    Registration order is known on every rank without running the model, so a
    layer's index names it everywhere. A parameter shared by two modules
    belongs to the first.
    """
    seen: set[int] = set()
    found = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            found.append((name or "<root>", module, params))
    return found


def trace(model: nn.Module, example: torch.Tensor) -> OpGraph:
    """Trace ``model``'s forward on ``example`` (a batch) and time each operation.

    Example::

        >>> graph = trace(build_model("lenet"), torch.zeros(8, 1, 32, 32))
        >>> graph.ops[graph.consumers(0)[0]].name
        'features.0'
    """
    replica = copy.deepcopy(model)
    replica.train(model.training)
    layers = model_layers(replica)
    names = [name for name, _, _ in layers]
    nbytes = [sum(p.numel() * p.element_size() for p in params) for _, _, params in layers]
    try:
        ops = _trace_fx(replica, layers, example)
        method = "fx"
    except Exception:  # data-dependent control flow and the like: fx cannot trace it
        ops = _trace_hooks(replica, layers, example)
        method = "hooks"
    return OpGraph(ops, names, nbytes, method)


def _trace_fx(model: nn.Module, layers: list, example: torch.Tensor) -> list[Op]:
    import torch.fx

    module_layer = {id(module): i for i, (_, module, _) in enumerate(layers)}
    param_layer = {id(p): i for i, (_, _, params) in enumerate(layers) for p in params}
    gm = torch.fx.symbolic_trace(model)
    timer = _TimingInterpreter(gm)
    with torch.no_grad():
        for _ in range(_REPEATS + 1):
            timer.run(example)
    index: dict[torch.fx.Node, int] = {}
    param_of: dict[torch.fx.Node, int] = {}   # get_attr nodes that fetch a parameter -> its layer
    ops: list[Op] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            target = _fetch(gm, node.target)
            if isinstance(target, torch.Tensor) and id(target) in param_layer:
                param_of[node] = param_layer[id(target)]
            continue
        op = Op(name=str(node.target) if node.op == "call_module" else node.name,
                time_s=min(timer.times.get(node, [0.0])))
        if node.op == "call_module":
            owner = module_layer.get(id(gm.get_submodule(node.target)))
            if owner is not None:
                op.layers.append(owner)
        for arg in node.all_input_nodes:
            if arg in param_of and param_of[arg] not in op.layers:
                op.layers.append(param_of[arg])
            elif arg in index:
                op.inputs.append(index[arg])
        index[node] = len(ops)
        ops.append(op)
    return ops


def _fetch(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _TimingInterpreter:
    """Runs a GraphModule node by node, recording each node's run time."""

    def __init__(self, gm: Any):
        import torch.fx

        times: dict = {}

        class Timed(torch.fx.Interpreter):
            def run_node(self, n):  # noqa: D401 (torch.fx's hook)
                start = time.perf_counter()
                result = super().run_node(n)
                times.setdefault(n, []).append(time.perf_counter() - start)
                return result

        self._interpreter = Timed(gm)
        self.times = times

    def run(self, *args: Any) -> Any:
        return self._interpreter.run(*args)


def _trace_hooks(model: nn.Module, layers: list, example: torch.Tensor) -> list[Op]:
    """Modules in the order they ran; leaf modules and parameter owners are operations."""
    module_layer = {id(module): i for i, (_, module, _) in enumerate(layers)}
    watched = [(name, m) for name, m in model.named_modules()
               if name and (not list(m.children()) or id(m) in module_layer)]
    records: list[list] = []   # [name, layer or None, [durations]] in first-call order
    slot: dict[int, int] = {}
    starts: dict[int, float] = {}
    handles = []

    def pre(key: int, name: str, layer: int | None):
        def hook(module, args):
            if key not in slot:
                slot[key] = len(records)
                records.append([name, layer, []])
            starts[key] = time.perf_counter()
        return hook

    def post(key: int):
        def hook(module, args, output):
            records[slot[key]][2].append(time.perf_counter() - starts[key])
        return hook

    for name, module in watched:
        key = id(module)
        handles.append(module.register_forward_pre_hook(pre(key, name, module_layer.get(key))))
        handles.append(module.register_forward_hook(post(key)))
    try:
        with torch.no_grad():
            for repeat in range(_REPEATS + 1):
                model(example)
                if repeat == 0:
                    for record in records:
                        record[2].clear()
    finally:
        for handle in handles:
            handle.remove()
    ops = []
    for i, (name, layer, durations) in enumerate(records):
        # A module called several times per forward counts all its calls.
        ops.append(Op(name, inputs=[i - 1] if i else [], layers=[] if layer is None else [layer],
                      time_s=sum(durations) / _REPEATS))
    return ops
