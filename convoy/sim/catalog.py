"""Strategies by name, and every setting of their knobs that ``convoy plan`` tries."""
from __future__ import annotations

from dataclasses import dataclass, replace

from convoy.errors import UsageError
from convoy.sim.codec import Compression
from convoy.sim.cpu import CpuCosts
from convoy.sim.strategies import DDP, AllReduce, Hierarchical, Hybrid, ParameterServer, Strategy

STRATEGY_NAMES = ("allreduce", "fp16", "randomk", "topk", "blocktopk", "hierarchical", "ps", "hybrid",
                  "ddp", "powersgd")


@dataclass(frozen=True)
class Knobs:
    """The settings a named strategy takes (``convoy train``'s flags of the same names).

    Example::

        >>> build("topk", Knobs(element_fraction=0.001), nodes=4).label
        'allreduce topk 0.001'
    """

    element_fraction: float = 0.01
    blocks_per_layer: int | None = None
    block_fraction: float | None = None
    block_selection: str = "local"
    clusters: int = 2
    exchange_every: int = 10
    servers: int = 1
    priority: str = "graph"
    slice_kb: float | None = 256
    conv_workers: int | None = None
    fc_workers: int | None = None
    powersgd_rank: int = 1


def build(name: str, knobs: Knobs, nodes: int, costs: CpuCosts | None = None) -> Strategy:
    """The strategy called ``name`` with ``knobs``, for a cluster of ``nodes``.

    Raises:
        UsageError: an unknown name or knobs that do not fit.
    """
    if name in ("allreduce", "fp16", "randomk", "topk", "blocktopk"):
        compression = Compression("none" if name == "allreduce" else name, knobs.element_fraction,
                                  knobs.blocks_per_layer, knobs.block_fraction, knobs.block_selection)
        return AllReduce(compression, costs)
    if name == "hierarchical":
        return Hierarchical(knobs.clusters, knobs.exchange_every, costs)
    if name == "ps":
        return ParameterServer(knobs.servers, knobs.priority, knobs.slice_kb, costs)
    if name == "hybrid":
        fc = knobs.fc_workers or max(1, nodes // 4)
        return Hybrid(knobs.conv_workers or nodes - fc, fc, costs)
    if name in ("ddp", "powersgd"):
        return DDP(knobs.powersgd_rank if name == "powersgd" else 0, costs=costs)
    raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")


def candidates(nodes: int, racks: int = 1, has_head: bool = True, costs: CpuCosts | None = None) -> list[Strategy]:
    """Every convoy strategy and knob setting worth predicting on ``nodes`` nodes.

    Densities stop at 1% and exchange periods at 20 steps: beyond them the
    README's accuracy runs show training suffering, and plan ranks speed only.
    """
    out: list[Strategy] = [AllReduce(Compression(), costs), AllReduce(Compression("fp16"), costs)]
    for fraction in (0.1, 0.01):
        out += [AllReduce(Compression("topk", fraction), costs), AllReduce(Compression("randomk", fraction), costs)]
    out += [AllReduce(Compression("blocktopk", block_fraction=f, selection=s), costs)
            for f in (0.1, 0.01) for s in ("local", "global")]
    out.append(AllReduce(Compression("blocktopk", blocks_per_layer=1), costs))
    for k in sorted({racks, *(d for d in (2, 4, 8) if d < nodes)}):
        if 1 < k < nodes and nodes % k == 0:
            out += [Hierarchical(k, t, costs) for t in (1, 5, 20)]
    for servers in sorted({1, 2, max(1, nodes // 4)}):
        if servers < nodes:
            out.append(ParameterServer(servers, "fifo", None, costs))
            out += [ParameterServer(servers, "graph", kb, costs) for kb in (64, 256, 1024)]
    if has_head:
        for fc in range(1, nodes // 2 + 1):
            if (nodes - fc) % fc == 0:
                out.append(Hybrid(nodes - fc, fc, costs))
    return out


def from_flags(flags: list[str], nodes: int, costs: CpuCosts | None = None) -> Strategy:
    """The strategy a ``convoy train`` (or DDP peer) command line selects: the inverse of ``flags()``.

    Example::

        >>> from_flags(["--compress", "blocktopk", "--block-fraction", "0.1"], 4).label
        'allreduce blocktopk 0.1'
    """
    values: dict[str, str] = {}
    for i, flag in enumerate(flags):
        if flag.startswith("--") and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            values[flag[2:].replace("-", "_")] = flags[i + 1]
    number = {"element_fraction": float, "blocks_per_layer": int, "block_fraction": float, "clusters": int,
              "exchange_every": int, "servers": int, "slice_kb": float, "conv_workers": int, "fc_workers": int,
              "powersgd_rank": int}
    knobs = Knobs(**{k: number[k](v) for k, v in values.items() if k in number},
                  **{k: values[k] for k in ("block_selection", "priority") if k in values})
    if knobs.priority == "fifo" and "slice_kb" not in values:
        knobs = replace(knobs, slice_kb=None)   # fifo sends whole layers by default
    if "powersgd_rank" in values:
        name = "powersgd" if knobs.powersgd_rank else "ddp"
    elif any(f.endswith(".py") for f in flags):
        name = "ddp"
    elif values.get("parallel") == "hybrid":
        name = "hybrid"
    elif values.get("sync", "allreduce") != "allreduce":
        name = values["sync"]
    else:
        name = values.get("compress", "none").replace("none", "allreduce")
    return build(name, knobs, nodes, costs)
