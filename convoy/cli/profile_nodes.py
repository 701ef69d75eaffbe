"""``convoy profile-nodes``: measure every node, normalise, cluster, elect, and show it."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from convoy.cli.errors import run_and_exit
from convoy.cli.launch import run_ranks
from convoy.cluster import (DEFAULT_CLUSTERS, DEFAULT_REELECT_EVERY, DEFAULT_SERVER_CHOICE, DEFAULT_WEIGHTS,
                            INDICATORS, SERVER_CHOICES, ClusterPlan, load_profile_file, parse_clusters, parse_weights,
                            plan_job)
from convoy.cluster.options import check_cluster_options
from convoy.errors import UsageError
from convoy.runtime import launched_by_torchrun

DESCRIPTION = """\
Profile the nodes of a job as `convoy train --sync hierarchical` does: each
rank measures CPU clock, memory, GPU clock and memory, disk throughput and
uplink bandwidth (--node-profile FILE overrides any of them); rank 0
normalises, weights and clusters them and elects each cluster's server.
Locally it starts --nproc ranks; under torchrun (or `convoy bench cluster --
profile-nodes`) each process is one rank. Prints a table, or JSON with --json.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("profile-nodes", help="profile and cluster the nodes of a job",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to start (ignored under torchrun; "
                        "default: 2)")
    parser.add_argument("--node-profile", metavar="FILE", help="TOML file of indicators overriding the "
                        "measured ones ([all], [hosts.NAME], [ranks.N] tables)")
    parser.add_argument("--clusters", default=DEFAULT_CLUSTERS, help="number of clusters K, or auto (default: "
                        "%(default)s)")
    parser.add_argument("--indicator-weights", help="name=value pairs or six numbers (default: "
                        + ",".join(f"{DEFAULT_WEIGHTS[name]:g}" for name in INDICATORS) + " for "
                        + ",".join(INDICATORS) + ")")
    parser.add_argument("--server-choice", default=DEFAULT_SERVER_CHOICE, choices=SERVER_CHOICES,
                        help="how each cluster's server is elected (default: %(default)s)")
    parser.add_argument("--reelect-every", type=int, default=DEFAULT_REELECT_EVERY,
                        help="exchange cycles per election (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of k-means and the election (default: 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)
    worker = subparsers.add_parser("_profile_worker")
    worker.add_argument("args_json")
    worker.set_defaults(func=_run_worker_from_json)


def check_options(args: argparse.Namespace, world: int) -> None:
    """Every check of ``convoy profile-nodes``' options that needs no worker, so bad input fails before any starts.

    Args:
        args: the parsed ``profile-nodes`` options.
        world: the number of ranks the job will have.

    Raises:
        UsageError: naming the first bad option.
    """
    if world < 1:
        raise UsageError(f"--nproc must be >= 1, got {world}")
    check_cluster_options(world, args.clusters, args.indicator_weights, args.node_profile, args.reelect_every,
                          args.server_choice)


def run(args: argparse.Namespace) -> int:
    if launched_by_torchrun():
        check_options(args, int(os.environ["WORLD_SIZE"]))
        _run_worker(args)
    check_options(args, args.nproc)
    values = {k: v for k, v in vars(args).items() if k != "func"}
    argv = [sys.executable, "-m", "convoy", "_profile_worker", json.dumps(values)]
    return run_ranks(lambda rank: argv, args.nproc, "127.0.0.1", "lo")


def _run_worker_from_json(args: argparse.Namespace) -> NoReturn:
    _run_worker(argparse.Namespace(**json.loads(args.args_json)))


def _run_worker(args: argparse.Namespace) -> NoReturn:
    from convoy import runtime

    rank = int(os.environ.get("RANK", 0))

    def body() -> None:
        ctx = runtime.init()
        overrides = load_profile_file(args.node_profile) if args.node_profile else None
        plan = plan_job(parse_weights(args.indicator_weights), parse_clusters(args.clusters), args.seed,
                        args.reelect_every, args.server_choice, overrides, ctx.local_rank)
        runtime.shutdown()
        if rank == 0:
            print(json.dumps(plan.as_json(), indent=2) if args.json else render(plan), flush=True)

    run_and_exit(body, rank)


def render(plan: ClusterPlan) -> str:
    """The plan as a table per node, then the weights, clusters and servers."""
    servers = plan.servers(0)
    head = ["rank", "host", *INDICATORS, "normalised", "cluster", "server"]
    rows = [[str(p.rank), p.host, *(f"{getattr(p, name):.4g}" + ("*" if name in p.from_file else "")
                                     for name in INDICATORS),
             " ".join(f"{v:+.2f}" for v in normalised), str(plan.cluster_of(p.rank)),
             "yes" if p.rank in servers else ""]
            for p, normalised in zip(plan.profiles, plan.normalised)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in [head, *rows]]
    weights = ", ".join(f"{name}={w:g}" for name, w in plan.weights.items())
    starred = any(p.from_file for p in plan.profiles)
    lines += ["", *(["* from --node-profile"] if starred else []), f"weights: {weights}",
              f"clusters: {plan.clusters}", f"servers (first election, {plan.election.choice}, "
              f"re-elected every {plan.election.every} cycles): {servers}"]
    warning = plan.noise_warning()
    if warning:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
