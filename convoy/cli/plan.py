"""``convoy plan``: rank every strategy and knob setting for a cluster, with the command to run each."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any, Sequence

from convoy.cli.sim_args import add_model_args, resolve_profile
from convoy.errors import UsageError
from convoy.sim.catalog import candidates, peers
from convoy.sim.cluster import Cluster, load_cluster
from convoy.sim.codec import Compression
from convoy.sim.convergence import Convergence, load_convergence
from convoy.sim.profile import ModelProfile
from convoy.sim.strategies import LayerRing, Strategy
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
  rate = "100mbit"          # each host's link (or rates = [...], one per node)
  racks = 2                 # optional, with inter_rack_rate = "50mbit"
  latency_ms = 0.1          # optional
  wake_ms = 1               # optional: a receiver's per-message time on busy shared cores
  speeds = [1, 1, 0.5, 1]   # optional relative compute speed per node
  cores = 0.5               # optional CPU cores per rank (emulated hosts)

or the JSON of convoy profile-nodes --json (per-node uplink_mbps and clock
rates; its clusters become racks).

By itself plan ranks speed per step, not accuracy: sparse compression, long
exchange periods and fewer data workers can cost steps (docs/benchmarks.md
shows measured runs). --steps-to-target FILE gives it each strategy's measured steps
to a target accuracy, and plan ranks by steps x predicted step time. Steps
do not depend on the link, so measure them once (same model, batch and
number of nodes) on any cluster, e.g. the emulated one of convoy bench:

  {"model": "resnet18", "batch_size": 16, "nodes": 4, "target": 0.97,
   "runs": [{"flags": "--compress fp16", "steps_to_target": 50},
            {"flags": "--compress topk", "steps_to_target": 175},
            {"flags": "--compress blocktopk --block-fraction 0.01",
             "steps_to_target": null}]}

(flags as plan prints them; null: never reached the target; model,
batch_size, nodes and target are optional and checked when given).

Each row's command runs the setting on this machine (convoy train --nproc N,
e.g. on emulated hosts). For a cluster of several machines, plan then prints
one torchrun command per node for the first row (--json: node_commands of
every row); give node 0's address with --master-addr.

The peers a user would otherwise run, torch DDP and DDP with torch's
PowerSGD hook (ranks 1, 2, 4), are ranked beside convoy's settings (marked
"peer"); plan says whether convoy's best or a peer is predicted to win, and
by how much.

Strategies whose flags this convoy does not have yet are listed as
unavailable and never ranked first.

Examples:
  convoy plan cluster.toml --model vgg_fc --batch-size 16 --top 10
  convoy plan cluster.toml --model resnet18 --batch-size 16 --steps-to-target steps.json
"""

# The per-node torchrun commands: node 0's port (torchrun's own default), and the address that stands
# for node 0's until the user gives it.
DEFAULT_MASTER_PORT = 29500
PLACEHOLDER_HOST = "HOST0"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="rank strategies for a cluster and print the command for each",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", metavar="CLUSTER", help="cluster description (TOML/JSON) or profile-nodes JSON")
    add_model_args(p)
    p.add_argument("--top", type=int, default=15, help="rows to print (default: 15; --json prints all)")
    p.add_argument("--steps-to-target", metavar="FILE",
                   help="measured steps to a target accuracy per strategy (JSON, see below): rank by predicted "
                        "time to that accuracy instead of samples per second")
    p.add_argument("--master-addr", metavar="HOST", help="node 0's address in the per-node torchrun commands "
                   f"(default: node 0's host in a profile-nodes JSON, else the placeholder {PLACEHOLDER_HOST})")
    p.add_argument("--master-port", metavar="PORT", type=int, default=DEFAULT_MASTER_PORT,
                   help="the port node 0 listens on for the others (default: %(default)s)")
    p.set_defaults(func=run)


def train_flags() -> set[str]:
    """Every ``convoy train`` flag that exists in this convoy (read from its config table)."""
    from convoy.train.config import config_settings

    return {setting.flag for setting in config_settings()}


def train_choices() -> dict[str, tuple[str, ...]]:
    """The values ``--sync``, ``--compress`` and ``--parallel`` accept in this convoy."""
    from convoy.compress import compressor_names
    from convoy.train.layouts import LAYOUTS
    from convoy.train.strategies import STRATEGIES

    return {"--sync": STRATEGIES.names(), "--compress": compressor_names(), "--parallel": LAYOUTS.names()}


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


PEER_SCRIPT = "bench/peers/ddp_train.py"


def command(strategy: Strategy, nodes: int, model: str, batch_size: int, extra: Sequence[str] = ()) -> str:
    """The ``convoy train`` line that runs ``strategy`` on this machine, one process per node
    (a peer: the torchrun line of convoy's DDP peer script, from a convoy checkout)."""
    if strategy.peer:
        return shlex.join(["torchrun", "--nproc-per-node", str(nodes), PEER_SCRIPT, "--model", model,
                           "--batch-size", str(batch_size), *strategy.flags(), "--steps", "STEPS", "--out", "DIR"])
    return shlex.join(["convoy", "train", "--nproc", str(nodes), *_train_args(strategy, model, batch_size, extra)])


def node_commands(strategy: Strategy, nodes: int, model: str, batch_size: int, extra: Sequence[str] = (),
                  master_addr: str = PLACEHOLDER_HOST, master_port: int = DEFAULT_MASTER_PORT) -> list[str]:
    """One torchrun line per machine that runs ``strategy`` across ``nodes`` machines, a process each.

    Node i runs the i-th line; node 0 listens at ``master_addr:master_port``.
    Ranks follow node order, so the plan's racks are consecutive nodes.

    Example::

        >>> node_commands(strategy, 2, "vgg_fc", 16, master_addr="10.0.0.1")[1]
        'torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 10.0.0.1 ... -m convoy train ...'
    """
    return [shlex.join(["torchrun", "--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", "1",
                        "--master-addr", master_addr, "--master-port", str(master_port), "-m", "convoy", "train",
                        *_train_args(strategy, model, batch_size, extra)])
            for node in range(nodes)]


def _train_args(strategy: Strategy, model: str, batch_size: int, extra: Sequence[str]) -> list[str]:
    return ["--model", model, "--batch-size", str(batch_size), *strategy.flags(), *extra]


def rank(profile: ModelProfile, cluster: Cluster, strategies: list[Strategy], known: set[str],
         choices: dict[str, tuple[str, ...]], convergence: Convergence | None = None,
         master_addr: str = PLACEHOLDER_HOST, master_port: int = DEFAULT_MASTER_PORT) -> list[dict]:
    """Predict every strategy; the best available first, unavailable ones after.

    Best is the most samples per second, or with ``convergence`` (measured steps
    to a target accuracy per strategy) the shortest predicted time to the
    target. Then strategies whose steps were not measured follow by samples per
    second, and last those that never reached the target.
    """
    rows = []
    for strategy in strategies:
        b = strategy.step_time(profile, cluster)
        extra = convergence.warmup_flags() if convergence and convergence.warms_up(strategy) else []
        row = {**b.to_json(), "samples_per_s": strategy.workers(cluster) * profile.batch_size / b.step_s,
               "peer": strategy.peer,
               "available": strategy.peer or available(strategy.flags(), known, choices),
               "command": command(strategy, cluster.nodes, profile.name, profile.batch_size, extra),
               "node_commands": [] if strategy.peer else node_commands(
                   strategy, cluster.nodes, profile.name, profile.batch_size, extra, master_addr, master_port)}
        if convergence is not None:
            warmup_s = warmup_step_s(strategy, profile, cluster) if convergence.warms_up(strategy) else 0.0
            row.update(measured=strategy.label in convergence.steps,
                       steps_to_target=convergence.steps.get(strategy.label),
                       time_to_target_s=convergence.time_to_target(strategy, b.step_s, warmup_s))
        rows.append(row)
    rows.sort(key=_order)
    for i, row in enumerate(rows, 1):
        row["rank"] = i
    return rows


def warmup_step_s(strategy: Strategy, profile: ModelProfile, cluster: Cluster) -> float:
    """A warm-up step's predicted time: a sparse compressor's at the mean density of its
    ramp (25% down to its own), the others' dense (they send their warm-up uncompressed)."""
    compression = getattr(strategy, "compression", Compression())
    ramped = compression.ramp_mean() if compression.density is not None else Compression()
    return LayerRing(ramped, getattr(strategy, "costs", None)).step_time(profile, cluster).step_s


def verdict(rows: list[dict]) -> str | None:
    """One line saying whether convoy's best or the best peer is predicted to win, and by how much.

    Rows are ranked already; the measure is the time to target where both have
    one, else samples per second.

    Example::

        >>> verdict([{"strategy": "ddp powersgd 2", "peer": True, ...}, {"strategy": "allreduce", ...}])
        'a peer would win: ddp powersgd 2 is predicted 1.20x faster than convoy's best (allreduce); ...'
    """
    ours = next((r for r in rows if not r["peer"] and r["available"]), None)
    peer = next((r for r in rows if r["peer"]), None)
    if ours is None or peer is None:
        return None
    if ours.get("time_to_target_s") and peer.get("time_to_target_s"):
        ratio, what = peer["time_to_target_s"] / ours["time_to_target_s"], "to the target"
    else:
        ratio, what = ours["samples_per_s"] / peer["samples_per_s"], "in samples per second"
    if rows.index(peer) < rows.index(ours):
        return (f"a peer would win: {peer['strategy']} is predicted {1 / ratio:.2f}x faster {what} than convoy's "
                f"best ({ours['strategy']}); run it instead ({peer['command']})")
    return f"convoy wins: {ours['strategy']} is predicted {ratio:.2f}x faster {what} than the best peer " \
           f"({peer['strategy']})"


def _order(row: dict) -> tuple:
    if "measured" not in row:
        return (not row["available"], -row["samples_per_s"])
    if row["time_to_target_s"] is not None:
        return (not row["available"], 0, row["time_to_target_s"])
    return (not row["available"], 1 if not row["measured"] else 2, -row["samples_per_s"])


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    cluster = load_cluster(args.cluster)
    convergence = load_convergence(args.steps_to_target, cluster.nodes) if args.steps_to_target else None
    profile, costs = resolve_profile(args)
    has_head = any(l.head for l in profile.layers) and any(not l.head for l in profile.layers)
    strategies = {s.label: s for s in candidates(cluster.nodes, cluster.racks, has_head, costs)}
    if convergence:
        convergence.check(profile.name, profile.batch_size, cluster.nodes)
        # Measured settings whose knobs plan does not try itself are ranked too.
        strategies.update({s.label: s for s in convergence.strategies(cluster.nodes, costs)
                           if s.label not in strategies})
    strategies.update({s.label: s for s in peers(costs) if s.label not in strategies})
    master_addr = args.master_addr or _node0_host(args.cluster) or PLACEHOLDER_HOST
    rows = rank(profile, cluster, list(strategies.values()), train_flags(), train_choices(),
                convergence, master_addr, args.master_port)
    if args.json:
        print(json.dumps({"model": profile.name, "batch_size": profile.batch_size, "nodes": cluster.nodes,
                          "target": convergence.target if convergence else None, "verdict": verdict(rows),
                          "rows": rows}, indent=1))
        return 0
    by = "shortest predicted time to target first" if convergence else "fastest first"
    print(f"{profile.name}, batch {profile.batch_size} per worker, on {cluster.nodes} nodes at "
          f"{cluster.rate_bps / 1e6:g} Mbit/s: {len(rows)} settings, {by}")
    print(format_table(*_table(rows[:args.top], convergence is not None)))
    line = verdict(rows)
    if line:
        print(f"\n{line[0].upper()}{line[1:]}.")
    if cluster.nodes > 1 and rows[0]["available"] and not rows[0]["peer"]:
        where = f"node 0 is {master_addr}" if master_addr != PLACEHOLDER_HOST else \
            f"{PLACEHOLDER_HOST}: node 0's address, reachable from the others"
        print(f"\nThe first row on {cluster.nodes} machines, one process each ({where}); run line i on node i:")
        for line in rows[0]["node_commands"]:
            print(f"  {line}")
    return 0


def _node0_host(path: str) -> str | None:
    """Node 0's host name when the cluster file is the JSON of convoy profile-nodes, else None."""
    try:
        nodes = json.loads(Path(path).read_text()).get("nodes")
        first = min(nodes, key=lambda n: int(n.get("rank", 0)))
        return str(first["host"]) if first.get("host") else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _table(rows: list[dict], with_steps: bool) -> tuple[list[str], list[list]]:
    header = ["#", "strategy", "step s", "samples/s"]
    if with_steps:
        header += ["steps to target", "time to target s"]
    table = []
    for r in rows:
        cells = [r["rank"], r["strategy"] + (" (peer)" if r["peer"] else ""), r["step_s"], r["samples_per_s"]]
        if with_steps:
            cells += [r["steps_to_target"] or ("not reached" if r["measured"] else "-"),
                      r["time_to_target_s"] if r["time_to_target_s"] is not None else "-"]
        table.append(cells + [r["command"] if r["available"] else "(not in this convoy) " + r["command"]])
    return header + ["command"], table
