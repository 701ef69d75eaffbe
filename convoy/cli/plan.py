"""``convoy plan``: rank every strategy and knob setting for a cluster, with the command to run each."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from typing import Any

from convoy.cli.sim_args import add_model_args, resolve_profile
from convoy.errors import UsageError
from convoy.sim.catalog import candidates
from convoy.sim.cluster import Cluster, load_cluster
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies import Strategy
from convoy.sim.table import format_table

DESCRIPTION = """\
Recommend how to train a model on a cluster: run the simulator (see convoy
simulate --help) over every convoy strategy and its knobs (compression
density, hierarchical clusters and exchange period, parameter servers,
priority and slice size, hybrid conv/FC splits) and print them ranked by
predicted throughput (samples per second: ps and hybrid train on fewer ranks
than the cluster has), each with the convoy train command that runs it.

CLUSTER is a TOML or JSON file: either the simulator's keys

  nodes = 4
  rate = "100mbit"          # each host's link
  racks = 2                 # optional, with inter_rack_rate = "50mbit"
  latency_ms = 0.1          # optional
  wake_ms = 1               # optional: a receiver's per-message time on busy shared cores
  speeds = [1, 1, 0.5, 1]   # optional relative compute speed per node
  cores = 0.5               # optional CPU cores per rank (emulated hosts)

or the JSON of convoy profile-nodes --json (per-node uplink_mbps and clock
rates; its clusters become racks).

Plan ranks speed per step, not accuracy: sparse compression and long
exchange periods can cost accuracy (see the README's Compression section).
Strategies whose flags this convoy does not have yet are listed as
unavailable and never ranked first.

Example:
  convoy plan cluster.toml --model vgg_fc --batch-size 16 --top 10
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="rank strategies for a cluster and print the command for each",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", metavar="CLUSTER", help="cluster description (TOML/JSON) or profile-nodes JSON")
    add_model_args(p)
    p.add_argument("--top", type=int, default=15, help="rows to print (default: 15; --json prints all)")
    p.set_defaults(func=run)


def train_flags() -> set[str]:
    """Every ``convoy train`` flag that exists in this convoy (read from its config table)."""
    from convoy.train.config import TrainConfig

    return {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}


def train_choices() -> dict[str, tuple[str, ...]]:
    """The values ``--sync``, ``--compress`` and ``--parallel`` accept in this convoy."""
    from convoy.compress import COMPRESS_NAMES
    from convoy.parallel import PARALLEL_NAMES
    from convoy.sync import SYNC_NAMES

    return {"--sync": SYNC_NAMES, "--compress": COMPRESS_NAMES, "--parallel": PARALLEL_NAMES}


def available(flags: list[str], known: set[str], choices: dict[str, tuple[str, ...]]) -> bool:
    """Whether ``convoy train`` accepts every flag (and every named choice) in ``flags``.

    Example::

        >>> available(["--sync", "ps"], {"--sync"}, {"--sync": ("allreduce",)})
        False
    """
    for i, flag in enumerate(flags):
        if not flag.startswith("--"):
            continue
        if flag not in known:
            return False
        if flag in choices and (i + 1 >= len(flags) or flags[i + 1] not in choices[flag]):
            return False
    return True


def command(strategy: Strategy, nodes: int, model: str, batch_size: int) -> str:
    """The ``convoy train`` line that runs ``strategy`` (the same flags work under torchrun)."""
    return shlex.join(["convoy", "train", "--nproc", str(nodes), "--model", model,
                       "--batch-size", str(batch_size), *strategy.flags()])


def rank(profile: ModelProfile, cluster: Cluster, strategies: list[Strategy], known: set[str],
         choices: dict[str, tuple[str, ...]]) -> list[dict]:
    """Predict every strategy; fastest (samples/s) available first, unavailable ones after."""
    rows = []
    for strategy in strategies:
        b = strategy.step_time(profile, cluster)
        rows.append({**b.to_json(), "samples_per_s": strategy.workers(cluster) * profile.batch_size / b.step_s,
                     "available": available(strategy.flags(), known, choices),
                     "command": command(strategy, cluster.nodes, profile.name, profile.batch_size)})
    rows.sort(key=lambda r: (not r["available"], -r["samples_per_s"]))
    for i, row in enumerate(rows, 1):
        row["rank"] = i
    return rows


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    cluster = load_cluster(args.cluster)
    profile, costs = resolve_profile(args)
    has_head = any(l.head for l in profile.layers) and any(not l.head for l in profile.layers)
    rows = rank(profile, cluster, candidates(cluster.nodes, cluster.racks, has_head, costs),
                train_flags(), train_choices())
    if args.json:
        print(json.dumps({"model": profile.name, "batch_size": profile.batch_size, "nodes": cluster.nodes,
                          "rows": rows}, indent=1))
        return 0
    print(f"{profile.name}, batch {profile.batch_size} per worker, on {cluster.nodes} nodes at "
          f"{cluster.rate_bps / 1e6:g} Mbit/s: {len(rows)} settings, fastest first")
    table = [[r["rank"], r["strategy"], r["step_s"], r["samples_per_s"],
              r["command"] if r["available"] else "(not in this convoy) " + r["command"]] for r in rows[:args.top]]
    print(format_table(["#", "strategy", "step s", "samples/s", "command"], table))
    return 0
