"""``convoy bench cluster``: run a job across emulated hosts with shaped links."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from convoy.cli.launch import run_ranks
from convoy.emulation import EmulatedCluster, Stragglers, Topology, leftover_namespaces, parse_rate, remove_namespaces
from convoy.errors import UsageError

DESCRIPTION = """\
Build H emulated hosts (Linux network namespaces on a bridge per rack), shape
every host link and the links between racks with tc, run one rank of COMMAND
on each host over gloo, and tear everything down afterwards, also on failure
or Ctrl-C. Needs root and iproute2. Addresses are 198.18.0.1..H (RFC 2544's
benchmark range) and exist only inside the namespaces.

COMMAND is `train [convoy train options]`, `profile-nodes [options]` or
`SCRIPT.py [args]` (any torchrun-style script, e.g. a torch DDP peer). Example:

  convoy bench cluster --hosts 4 --rate 100mbit -- train --model vgg_fc --steps 50
  convoy bench cluster --hosts 4 --rate 1gbit --racks 2 --inter-rack-rate 50mbit -- train
  convoy bench cluster --hosts 4 --cluster bench/straggler.toml -- train --sync ps

A cluster file (--cluster) makes hosts slower than the others: [hosts.N] with
cpu = SHARE (its processes run SHARE of each 100 ms) and/or rate = "25mbit".
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks on emulated clusters")
    commands = bench.add_subparsers(title="commands", metavar="COMMAND")
    cluster = commands.add_parser("cluster", help="run a job across emulated hosts with shaped links",
                                  description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    cluster.add_argument("--hosts", type=int, default=4, help="number of hosts, one rank each (default: 4)")
    cluster.add_argument("--rate", default="100mbit", help="rate of each host's link, e.g. 100mbit, 1gbit "
                         "(default: 100mbit)")
    cluster.add_argument("--racks", type=int, default=1, help="racks the hosts are split into (default: 1)")
    cluster.add_argument("--inter-rack-rate", help="rate of the link joining the racks (needed with --racks > 1)")
    cluster.add_argument("--cluster", metavar="FILE", help="TOML file of slow hosts: [hosts.N] cpu = 0.25 "
                         "(share of the CPU), rate = \"25mbit\" (its link)")
    cluster.add_argument("--cleanup", action="store_true",
                         help="only remove namespaces left by runs that were killed, then exit")
    cluster.add_argument("command", nargs=argparse.REMAINDER, help="train [...] or SCRIPT.py [...]")
    cluster.set_defaults(func=run_cluster)


def _rank_command(command: list[str]) -> list[str]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("give the command to run on every host: train [...] or SCRIPT.py [...]")
    if command[0] in ("train", "profile-nodes"):
        return [sys.executable, "-m", "convoy", *command]
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    raise UsageError(f"unknown command {command[0]!r}; choose train, profile-nodes or a SCRIPT.py")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_cluster(args: argparse.Namespace) -> int:
    if args.cleanup:
        stale = leftover_namespaces()
        remove_namespaces(stale)
        print(f"convoy: removed {len(stale)} namespaces")
        return 0
    slow = Stragglers.read(args.cluster, args.hosts) if args.cluster else Stragglers()
    topology = Topology(args.hosts, parse_rate(args.rate), args.racks,
                        parse_rate(args.inter_rack_rate) if args.inter_rack_rate else None,
                        tuple(sorted(slow.rate.items())))
    argv = _rank_command(args.command)
    # The namespaces have no DNS; c10d warns about it on every connection.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # SIGTERM must unwind like Ctrl-C so the namespaces are removed.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with EmulatedCluster(topology) as cluster:
        links = f"{args.rate} host links" + (f", {args.inter_rack_rate} between racks" if args.racks > 1 else "")
        stragglers = f"; {slow.describe()}" if slow.describe() else ""
        print(f"convoy: {args.hosts} emulated hosts in {args.racks} rack(s), {links}{stragglers}", flush=True)
        return run_ranks(lambda rank: cluster.exec_prefix(rank) + slow.command(rank, argv), args.hosts,
                         topology.address(0), "eth0")
