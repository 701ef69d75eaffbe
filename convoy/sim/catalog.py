"""Strategies by name, and every setting of their knobs that ``convoy plan`` tries."""
from __future__ import annotations

from dataclasses import dataclass, replace

from convoy.errors import UsageError
from convoy.ps.settings import DEFAULT_PRIORITY, DEFAULT_SLICE_KB
from convoy.sim.codec import (DEFAULT_BLOCK_SIZE, DEFAULT_ELEMENT_FRACTION, DEFAULT_POWERSGD_RANK, DEFAULT_SELECTION,
                              Compression)
from convoy.sim.cpu import CpuCosts
from convoy.sim.strategies import ClusterCycles, ConvFcSplit, LayerRing, ServerShards, Strategy, TorchDDP
from convoy.sim.strategies.hierarchical import SIMULATED_CLUSTERS
from convoy.sync.hierarchical import DEFAULT_EXCHANGE_EVERY

# powersgd is the peer (DDP with torch's hook); convoy-powersgd is convoy's engine with --compress powersgd.
STRATEGY_NAMES = ("allreduce", "fp16", "randomk", "topk", "blocktopk", "convoy-powersgd", "hierarchical", "ps",
                  "hybrid", "ddp", "powersgd")
COMPRESSED_NAMES = ("fp16", "randomk", "topk", "blocktopk", "convoy-powersgd")


@dataclass(frozen=True)
class Knobs:
    """The settings a named strategy takes (``convoy train``'s flags of the same names).

    Example::

        >>> build("topk", Knobs(element_fraction=0.001), nodes=4).label
        'allreduce topk 0.001'
    """

    element_fraction: float = DEFAULT_ELEMENT_FRACTION
    blocks_per_layer: int | None = None
    block_fraction: float | None = None
    block_selection: str = DEFAULT_SELECTION
    block_size: int | None = DEFAULT_BLOCK_SIZE
    clusters: int = SIMULATED_CLUSTERS
    exchange_every: int = DEFAULT_EXCHANGE_EVERY
    servers: int = 1   # dedicated servers: the simulator has no model of colocated ones
    priority: str = DEFAULT_PRIORITY
    slice_kb: float | None = DEFAULT_SLICE_KB
    conv_workers: int | None = None
    fc_workers: int | None = None
    powersgd_rank: int = DEFAULT_POWERSGD_RANK


def build(name: str, knobs: Knobs, nodes: int, costs: CpuCosts | None = None) -> Strategy:
    """The strategy called ``name`` with ``knobs``, for a cluster of ``nodes``.

    Raises:
        UsageError: an unknown name or knobs that do not fit.
    """
    if name == "allreduce" or name in COMPRESSED_NAMES:
        compressor = {"allreduce": "none", "convoy-powersgd": "powersgd"}.get(name, name)
        compression = Compression(compressor, knobs.element_fraction, knobs.blocks_per_layer, knobs.block_fraction,
                                  knobs.block_selection, knobs.block_size, knobs.powersgd_rank)
        return LayerRing(compression, costs)
    if name == "hierarchical":
        return ClusterCycles(knobs.clusters, knobs.exchange_every, costs)
    if name == "ps":
        return ServerShards(knobs.servers, knobs.priority, knobs.slice_kb, costs)
    if name == "hybrid":
        fc = knobs.fc_workers or max(1, nodes // 4)
        return ConvFcSplit(knobs.conv_workers or nodes - fc, fc, costs)
    if name in ("ddp", "powersgd"):
        return TorchDDP(knobs.powersgd_rank if name == "powersgd" else 0, costs=costs)
    raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")


def candidates(nodes: int, racks: int = 1, has_head: bool = True, costs: CpuCosts | None = None) -> list[Strategy]:
    """Every convoy strategy and knob setting worth predicting on ``nodes`` nodes.

    Densities stop at 1% and exchange periods at 20 steps: beyond them the
    measured accuracy runs (bench/results) show training suffering, and plan
    ranks speed only.
    """
    out: list[Strategy] = [LayerRing(Compression(), costs), LayerRing(Compression("fp16"), costs)]
    for fraction in (0.1, 0.01):
        out += [LayerRing(Compression("topk", fraction), costs), LayerRing(Compression("randomk", fraction), costs)]
    out += [LayerRing(Compression("blocktopk", block_fraction=f, selection=s), costs)
            for f in (0.1, 0.01) for s in ("local", "global")]
    out.append(LayerRing(Compression("blocktopk", blocks_per_layer=1), costs))
    out += [LayerRing(Compression("powersgd", rank=rank), costs) for rank in (1, 2, 4)]
    for k in sorted({racks, *(d for d in (2, 4, 8) if d < nodes)}):
        if 1 < k < nodes and nodes % k == 0:
            out += [ClusterCycles(k, t, costs) for t in (1, 5, 20)]
    for servers in sorted({1, 2, max(1, nodes // 4)}):
        if servers < nodes:
            out.append(ServerShards(servers, "fifo", None, costs))
            out += [ServerShards(servers, "graph", kb, costs) for kb in (64, 256, 1024)]
    if has_head:
        for fc in range(1, nodes // 2 + 1):
            if (nodes - fc) % fc == 0:
                out.append(ConvFcSplit(nodes - fc, fc, costs))
    return out


# The ranks of torch's PowerSGD hook a DDP user sweeps. Up to 16 because resnet18 on digits needed
# fewer steps at each doubling up to 8, and at 16 fewer to 95% and as few to 97% (bench/steps_across_seeds.py).
PEER_POWERSGD_RANKS = (1, 2, 4, 8, 16)


def peers(costs: CpuCosts | None = None) -> list[Strategy]:
    """What a user would run instead of convoy: torch DDP, and DDP with torch's PowerSGD hook at each
    rank a user would sweep (:data:`PEER_POWERSGD_RANKS`)."""
    return [TorchDDP(0, costs=costs)] + [TorchDDP(rank, costs=costs) for rank in PEER_POWERSGD_RANKS]


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
    number = {"element_fraction": float, "blocks_per_layer": int, "block_fraction": float, "block_size": int,
              "clusters": int,
              "exchange_every": int, "servers": int, "slice_kb": float, "conv_workers": int, "fc_workers": int,
              "powersgd_rank": int}
    knobs = Knobs(**{k: number[k](v) for k, v in values.items() if k in number},
                  **{k: values[k] for k in ("block_selection", "priority") if k in values})
    if knobs.priority == "fifo" and "slice_kb" not in values:
        knobs = replace(knobs, slice_kb=None)   # fifo sends whole layers by default
    # The simulator's models are named as the flags they model; convoy.train's --sync and --parallel
    # registries lie above this package (pyproject's layers), and a choice registered there without a
    # model here is refused by build() in one line.
    if values.get("compress") == "powersgd":
        name = "convoy-powersgd"
    elif "powersgd_rank" in values:
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
