"""``convoy simulate``: predict one training step's time for each strategy on a cluster."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from convoy.cli.sim_args import add_model_args, resolve_profile
from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_PER_LAYER, DEFAULT_ELEMENT_FRACTION,
                             DEFAULT_POWERSGD_RANK, DEFAULT_SELECTION, SELECTIONS)
from convoy.emulation.topology import parse_rate
from convoy.errors import UsageError
from convoy.ps.settings import DEFAULT_PRIORITY, DEFAULT_SLICE_KB, PRIORITY_MODES
from convoy.sim.catalog import STRATEGY_NAMES, Knobs, build
from convoy.sim.cluster import Cluster, load_cluster
from convoy.sim.strategies.hierarchical import SIMULATED_CLUSTERS
from convoy.sim.table import format_table
from convoy.sync.hierarchical import DEFAULT_EXCHANGE_EVERY

# The simulated cluster's own defaults (racks, latency, wake-up, lanes) are the Cluster dataclass's.
_CLUSTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Cluster)}

DESCRIPTION = """\
Predict the time of one training step for each synchronisation strategy,
from the model's per-layer sizes and compute times (profiled here, forward
and backward per layer with hooks, or read with --profile) and a cluster
(nodes, link rate, racks, latency; or --cluster FILE).

The model follows convoy's engine: backward makes gradients ready in reverse
order, an auxiliary thread exchanges layers one at a time in that order and
updates each, and the next forward's layer l waits only for layer l's update.
Collectives are bandwidth-optimal rings (gloo's); a link carries payload at
95.6% of its rate (TCP over Ethernet). Peers: ddp (25 MB buckets, one
optimizer step after all) and powersgd (DDP with torch's PowerSGD hook);
convoy-powersgd is convoy's own (--compress powersgd: P all-reduced while the
auxiliary thread waits, then Q, layer by layer). Step times are for
--batch-size samples per data worker; ps and hybrid have fewer data workers
than nodes, so compare samples/s.

Examples:
  convoy simulate --model vgg_fc --batch-size 16 --nodes 4 --rate 100mbit
  convoy simulate --model resnet18 --nodes 64 --rate 10gbit --strategy allreduce ddp
  convoy simulate --profile net.json --cluster cluster.toml --json
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="predict step times of each strategy on a cluster",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    net = p.add_argument_group("cluster (or --cluster FILE)")
    net.add_argument("--cluster", metavar="FILE", help="TOML/JSON cluster description or convoy "
                     "profile-nodes --json output; overrides the options below")
    net.add_argument("--nodes", type=int, default=4, help="ranks, one per host (default: 4)")
    net.add_argument("--rate", default="1gbit", help="each host's link, e.g. 100mbit, 10gbit (default: 1gbit)")
    net.add_argument("--racks", type=int, default=_CLUSTER_DEFAULTS["racks"], help="equal racks (default: "
                     "%(default)s)")
    net.add_argument("--inter-rack-rate", help="rate of the links between racks")
    net.add_argument("--latency-ms", type=float, default=_CLUSTER_DEFAULTS["latency_s"] * 1e3,
                     help="one-way latency per message (default: %(default)g)")
    net.add_argument("--wake-ms", type=float, default=_CLUSTER_DEFAULTS["wake_s"] * 1e3, help="a receiver's "
                     "per-message time, hidden behind longer transfers: about 1-3 ms where busy ranks share cores "
                     "(default: %(default)g)")
    net.add_argument("--cores", type=float, help="CPU cores per rank when ranks share cores (0.5 for 4 "
                     "emulated hosts on 2 cores); default: a core per thread")
    net.add_argument("--lanes", type=int, default=_CLUSTER_DEFAULTS["lanes"], help="collectives a process group "
                     "runs at once: 2 for gloo (its worker threads), 1 for NCCL (one stream) (default: %(default)s)")
    s = p.add_argument_group("strategies and their knobs")
    s.add_argument("--strategy", nargs="+", default=list(STRATEGY_NAMES), metavar="NAME",
                   help="strategies to predict (default: all): " + ", ".join(STRATEGY_NAMES))
    s.add_argument("--element-fraction", type=float, default=DEFAULT_ELEMENT_FRACTION,
                   help="topk, randomk: share sent (default: %(default)s, convoy train's)")
    s.add_argument("--blocks-per-layer", type=int, help="blocktopk: blocks per parameter (default: "
                   f"{DEFAULT_BLOCKS_PER_LAYER})")
    s.add_argument("--block-fraction", type=float, help="blocktopk: share of blocks kept")
    s.add_argument("--block-selection", default=DEFAULT_SELECTION, choices=SELECTIONS,
                   help="blocktopk (default: %(default)s)")
    s.add_argument("--clusters", type=int, default=SIMULATED_CLUSTERS, help="hierarchical: K clusters (default: "
                   "%(default)s; convoy train's auto needs the profiled nodes)")
    s.add_argument("--exchange-every", type=int, default=DEFAULT_EXCHANGE_EVERY,
                   help="hierarchical: T steps per cycle (default: %(default)s, convoy train's)")
    s.add_argument("--servers", type=int, default=Knobs.servers, help="ps: S dedicated server ranks (default: "
                   "%(default)s; the simulator has no model of convoy train's colocated servers)")
    s.add_argument("--priority", default=DEFAULT_PRIORITY, choices=PRIORITY_MODES, help="ps (default: %(default)s; "
                   "timed is predicted as graph)")
    s.add_argument("--slice-kb", type=float, default=DEFAULT_SLICE_KB,
                   help="ps: slice size, 0 for whole layers (default: %(default)g, convoy train's)")
    s.add_argument("--conv-workers", type=int, help="hybrid: I (default: nodes - J)")
    s.add_argument("--fc-workers", type=int, help="hybrid: J (default: nodes / 4, at least 1)")
    s.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="blocktopk: elements per "
                   "block (default: %(default)s, convoy train's)")
    s.add_argument("--powersgd-rank", type=int, default=DEFAULT_POWERSGD_RANK, help="powersgd (the DDP "
                   "peer's hook) and convoy-powersgd: matrix rank (default: %(default)s, convoy train's)")
    p.set_defaults(func=run)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        return load_cluster(args.cluster)
    inter = parse_rate(args.inter_rack_rate) if args.inter_rack_rate else None
    return Cluster(args.nodes, parse_rate(args.rate), args.racks, inter, args.latency_ms / 1e3,
                   wake_s=args.wake_ms / 1e3, cores=args.cores, lanes=args.lanes)


def knobs_from_args(args: argparse.Namespace) -> Knobs:
    for flag, value in (("--block-size", args.block_size), ("--powersgd-rank", args.powersgd_rank)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    return Knobs(args.element_fraction, args.blocks_per_layer, args.block_fraction, args.block_selection,
                 args.block_size, args.clusters, args.exchange_every, args.servers, args.priority,
                 args.slice_kb or None, args.conv_workers, args.fc_workers, args.powersgd_rank)


def run(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args)
    knobs = knobs_from_args(args)
    unknown = [name for name in args.strategy if name not in STRATEGY_NAMES]
    if unknown:   # before the profiling, which takes seconds
        raise UsageError(f"unknown strategy {unknown[0]!r}; choose from: {', '.join(STRATEGY_NAMES)}")
    profile, costs = resolve_profile(args)
    rows = []
    for name in args.strategy:
        strategy = build(name, knobs, cluster.nodes, costs)
        try:
            b = strategy.step_time(profile, cluster)
        except UsageError as exc:
            if len(args.strategy) == 1:
                raise
            rows.append({"strategy": strategy.label, "skipped": str(exc)})
            continue
        samples = strategy.workers(cluster) * profile.batch_size / b.step_s
        rows.append({**b.to_json(), "samples_per_s": samples})
    if args.json:
        print(json.dumps({"model": profile.name, "batch_size": profile.batch_size, "params": profile.params,
                          "cluster": vars(cluster) | {"speeds": list(cluster.speeds)}, "rows": rows}, indent=1))
        return 0
    print(f"{profile.name}: {profile.params / 1e6:.2f} M parameters, batch {profile.batch_size} per worker, "
          f"compute {profile.compute_s:.3f} s per step ({profile.source}); {cluster.nodes} nodes at "
          f"{cluster.rate_bps / 1e9:g} Gbit/s" + (f", {cluster.racks} racks" if cluster.racks > 1 else ""))
    table = [[r["strategy"], r["step_s"], r["compute_s"], r["exposed_s"], r["sent_MB"], r["samples_per_s"]]
             if "step_s" in r else [r["strategy"], "-", "-", "-", "-", r["skipped"]] for r in rows]
    print(format_table(["strategy", "step s", "compute s", "exposed s", "MB sent/worker", "samples/s"], table))
    return 0
