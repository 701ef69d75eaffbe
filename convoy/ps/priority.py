"""Operation -> priority and parameter -> priority maps from the traced forward graph.

Each layer's parameters arrive on a worker through one receive operation. The
maps say in which order a server should send them for the next forward:

- ``graph`` (TicTac's TIC, P3's order): the receive that unblocks the earliest
  operation of the forward comes first. In an eager forward this is forward order.
- ``timed`` (TicTac's TAC, bounded by measured execution times): a greedy
  schedule over the operation graph that knows each operation's measured run
  time P and each receive's transfer time M (bytes / measured bandwidth). At
  every step, among the receives that alone unblock computation, it takes the
  first by Johnson's two-machine rule (receives with M < P by ascending M, then
  the rest by descending P), which starts computation soonest and keeps it fed;
  when none unblocks anything alone, it takes the one with the least
  communication still needed before some operation can run (M+). The bound
  T = sum(P) + sum(M), the forward with no overlap at all, is the value of a
  receive no operation waits for. A receive's priority value is the time its
  transfer would end in this schedule.

Layers that no traced operation reads (a parent uses the parameters itself)
are needed before the forward starts; both modes put them first.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from convoy.ps.trace_graph import OpGraph


@dataclass(frozen=True)
class PriorityPlan:
    """Priorities of every layer's receive.

    Attributes:
        mode: ``graph`` or ``timed``.
        order: layer indices, most urgent first.
        value: per layer, what the order sorts by: the index of the first
            operation that reads it (graph) or its estimated arrival in seconds (timed).
        op_priority: receive operation name (``recv:<layer>``) -> rank, 0 first.
        unseen: layers no traced operation reads.
        upper_bound_s: the execution-time bound T (timed only).
    """

    mode: str
    order: tuple[int, ...]
    value: tuple[float, ...]
    op_priority: dict[str, int]
    unseen: tuple[int, ...]
    upper_bound_s: float | None = None

    @property
    def rank(self) -> list[int]:
        """Per layer, its position in ``order`` (0: sent first)."""
        ranks = [0] * len(self.order)
        for position, layer in enumerate(self.order):
            ranks[layer] = position
        return ranks

    def parameter_priority(self, model: nn.Module) -> dict[str, int]:
        """Parameter name -> priority rank (0 first): every parameter takes its layer's rank."""
        from convoy.ps.trace_graph import model_layers

        ranks = self.rank
        names = {id(p): name for name, p in model.named_parameters()}
        return {names[id(p)]: ranks[i] for i, (_, _, params) in enumerate(model_layers(model)) for p in params}


def graph_priorities(graph: OpGraph) -> PriorityPlan:
    """Forward-need order: a receive ranks by the earliest operation that reads it.

    Example::

        >>> plan = graph_priorities(trace(build_model("lenet"), torch.zeros(8, 1, 32, 32)))
        >>> plan.order[0]   # the first convolution
        0
    """
    first = _first_reader(graph)
    order = sorted(range(len(first)), key=lambda layer: (first[layer], layer))
    return PriorityPlan("graph", tuple(order), tuple(float(f) for f in first), _op_map(graph, order),
                        tuple(_unseen(graph)))


def timed_priorities(graph: OpGraph, bandwidth: float) -> PriorityPlan:
    """TAC's greedy order from measured run times and transfer times (``bandwidth`` in bytes/s).

    Example::

        >>> plan = timed_priorities(graph, bandwidth=12.5e6)   # 100 Mbit/s
        >>> plan.upper_bound_s > max(plan.value)
        True
    """
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    n = len(graph.layer_bytes)
    transfer = [b / bandwidth for b in graph.layer_bytes]
    needs = _needs(graph)
    bound = sum(op.time_s for op in graph.ops) + sum(transfer)
    graph_rank = graph_priorities(graph).rank
    done: set[int] = set()
    order: list[int] = []
    value = [bound] * n
    clock = 0.0
    while len(order) < n:
        remaining = [layer for layer in range(n) if layer not in done]
        blocked = [(op.time_s, needs[i] - done) for i, op in enumerate(graph.ops) if needs[i] - done]
        unblocks = {layer: 0.0 for layer in remaining}      # P: compute this receive alone unblocks
        still_needed = {layer: bound for layer in remaining}  # M+: least communication before some op runs
        for time_s, missing in blocked:
            if len(missing) == 1:
                unblocks[next(iter(missing))] += time_s
            cost = sum(transfer[layer] for layer in missing)
            for layer in missing:
                still_needed[layer] = min(still_needed[layer], cost)
        ready = [layer for layer in remaining if unblocks[layer] > 0]
        if ready:
            pick = min(ready, key=lambda l: _johnson(transfer[l], unblocks[l], graph_rank[l]))
        else:
            pick = min(remaining, key=lambda l: (still_needed[l], graph_rank[l]))
        clock += transfer[pick]
        if any(pick in need for need in needs):
            value[pick] = clock
        done.add(pick)
        order.append(pick)
    return PriorityPlan("timed", tuple(order), tuple(value), _op_map(graph, order), tuple(_unseen(graph)), bound)


def _johnson(transfer: float, compute: float, tie: int) -> tuple:
    # Johnson's rule for a two-stage flow shop (wire, then CPU): jobs whose
    # transfer is shorter than the compute they unblock go first, shortest
    # transfer first; the others after, longest compute first.
    return (0, transfer, tie) if transfer < compute else (1, -compute, tie)


def _first_reader(graph: OpGraph) -> list[int]:
    first = [len(graph.ops)] * len(graph.layer_bytes)
    for i, op in enumerate(graph.ops):
        for layer in op.layers:
            first[layer] = min(first[layer], i)
    unseen = set(_unseen(graph))
    return [-1 if layer in unseen else f for layer, f in enumerate(first)]


def _unseen(graph: OpGraph) -> list[int]:
    read = {layer for op in graph.ops for layer in op.layers}
    return [layer for layer in range(len(graph.layer_bytes)) if layer not in read]


def _needs(graph: OpGraph) -> list[set[int]]:
    """Per operation, every layer it depends on, directly or through its inputs."""
    unseen = set(_unseen(graph))
    needs: list[set[int]] = []
    for op in graph.ops:
        need = set(op.layers) | unseen
        for i in op.inputs:
            need |= needs[i]
        needs.append(need)
    return needs


def _op_map(graph: OpGraph, order: list[int]) -> dict[str, int]:
    return {f"recv:{graph.layer_names[layer]}": rank for rank, layer in enumerate(order)}
