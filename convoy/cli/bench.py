"""``convoy bench cluster``: run a job across emulated hosts with shaped links."""
from __future__ import annotations

import argparse
import signal
import sys

from convoy.cli.launch import run_ranks
from convoy.emulation import (EmulatedCluster, Topology, leftover_namespaces, machine_congestion_control, parse_rate,
                              remove_namespaces)
from convoy.errors import UsageError
from convoy.sim.cluster import load_cluster

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
  convoy bench cluster --cluster straggler.toml -- train --model vgg_fc

--cluster FILE reads the hosts from a cluster file in the keys of
`convoy simulate --cluster` (nodes, rate or rates, racks, inter_rack_rate, speeds).
`rates = ["100mbit", "100mbit", "100mbit", "25mbit"]` puts the last host on a
slower link (shaped both ways).
`speeds = [1, 1, 1, 0.25]` makes the last host a straggler: its processes get a
quarter of the CPU share of the others (a cgroup CPU cap). The simulator's
latency_ms, wake_ms, cores and lanes have no effect here.

The hosts use this machine's TCP congestion control unless --tcp-congestion
names one (e.g. cubic, Linux's default, or bbr). How fully several flows that
share a shaped link fill it depends on it, so all-to-all traffic (parameter
servers) and a ring compare differently under each; bench/link_patterns.py
measures both patterns.
"""
DEFAULT_HOSTS, DEFAULT_RATE = 4, "100mbit"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks on emulated clusters")
    commands = bench.add_subparsers(title="commands", metavar="COMMAND")
    cluster = commands.add_parser("cluster", help="run a job across emulated hosts with shaped links",
                                  description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    cluster.add_argument("--hosts", type=int, help=f"number of hosts, one rank each (default: {DEFAULT_HOSTS})")
    cluster.add_argument("--rate", help="rate of each host's link, e.g. 100mbit, 1gbit "
                         f"(default: {DEFAULT_RATE})")
    cluster.add_argument("--racks", type=int, help="racks the hosts are split into (default: 1)")
    cluster.add_argument("--inter-rack-rate", help="rate of the link joining the racks (needed with --racks > 1)")
    cluster.add_argument("--cluster", metavar="FILE", help="hosts, links and host speeds from a cluster file "
                         "(TOML or JSON, see above) instead of --hosts/--rate/--racks")
    cluster.add_argument("--tcp-congestion", metavar="NAME",
                         help="TCP congestion control of every host, e.g. cubic or bbr (default: this machine's, "
                         "sysctl net.ipv4.tcp_congestion_control)")
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
    topology = _topology(args)
    argv = _rank_command(args.command)
    # SIGTERM must unwind like Ctrl-C so the namespaces are removed; the caller's handler comes
    # back afterwards (main() may run inside another program, e.g. a test).
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with EmulatedCluster(topology, congestion_control=args.tcp_congestion) as cluster:
            congestion = args.tcp_congestion or machine_congestion_control()
            print(f"convoy: {_describe(topology)}; TCP {congestion}", flush=True)
            return run_ranks(lambda rank: cluster.exec_prefix(rank) + argv, topology.hosts,
                             topology.address(0), "eth0")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _topology(args: argparse.Namespace) -> Topology:
    if args.cluster is None:
        inter = parse_rate(args.inter_rack_rate) if args.inter_rack_rate else None
        return Topology(DEFAULT_HOSTS if args.hosts is None else args.hosts, parse_rate(args.rate or DEFAULT_RATE),
                        1 if args.racks is None else args.racks, inter)
    given = [flag for flag, value in (("--hosts", args.hosts), ("--rate", args.rate), ("--racks", args.racks),
                                      ("--inter-rack-rate", args.inter_rack_rate)) if value is not None]
    if given:
        raise UsageError(f"--cluster FILE describes the hosts; drop {', '.join(given)} or drop --cluster")
    cluster = load_cluster(args.cluster)
    return Topology(cluster.nodes, cluster.rate_bps, cluster.racks, cluster.inter_rack_bps, cluster.speeds,
                    cluster.rates)


def _describe(topology: Topology) -> str:
    rates = sorted({topology.rate_of(h) for h in range(topology.hosts)})
    links = "/".join(f"{rate / 1e6:g}" for rate in rates) + " Mbit/s host links"
    if topology.racks > 1:
        links += f", {topology.inter_rack_rate / 1e6:g} Mbit/s between racks"
    slow = [f"host {h} at {topology.relative_speed(h):g}x" for h in range(topology.hosts)
            if topology.relative_speed(h) < 1]
    return (f"{topology.hosts} emulated hosts in {topology.racks} rack(s), {links}"
            + (f"; CPU capped: {', '.join(slow)}" if slow else ""))
