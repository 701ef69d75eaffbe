"""How fully each host's link is used under the traffic patterns of a ring and of colocated servers.

    python bench/link_patterns.py --hosts 4 --rate 100mbit --tcp-congestion bbr cubic

A ring all-reduce sends each host's bytes to one neighbour over one
connection; colocated parameter servers send every host's bytes to every other
host at once, in slices over several connections (``--sync ps``). Both put the
same bytes on every link, so a step's difference between them that no
computation explains is how well the hosts' TCP shares a shaped link among
several flows. Each pattern moves ``--mb`` MB from every host to each of the
other H - 1 (gloo sends, no model), once to warm the connections up and then
``--repeats`` times, on one emulated cluster per congestion control (root
needed): a step of a job repeats its pattern, so the figure is the pattern's
steady state, each host's uplink rate while it runs (median of the repeats),
and its ratio to the ring's in the same cluster. Writes
bench/results/link_patterns_<rate>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import launcher, save  # noqa: E402
from bench.figures import Block, percent, rows_of, table  # noqa: E402

SLICE_BYTES = 256 * 1024   # --sync ps's default slice
CONNECTIONS = 2            # --sync ps's default channels per pair of hosts
RING = "ring: to the next host, one connection"
# pattern name -> (send to, receive from) per phase, as a function of (rank, world size); slices; connections
PATTERNS: dict[str, tuple[Callable[[int, int], list[list[tuple[int, int]]]], bool, int]] = {
    RING: (lambda r, n: [[((r + 1) % n, (r - 1) % n)]] * (n - 1), False, 1),
    "in turns: one peer at a time, one connection each": (
        lambda r, n: [[((r + k) % n, (r - k) % n)] for k in range(1, n)], False, 1),
    "all-to-all: one message per peer": (
        lambda r, n: [[((r + k) % n, (r - k) % n) for k in range(1, n)]], False, 1),
    "all-to-all: 256 KB slices on 2 connections per peer (as --sync ps)": (
        lambda r, n: [[((r + k) % n, (r - k) % n) for k in range(1, n)]], True, CONNECTIONS),
}


def measure(mb: float, repeats: int) -> dict[str, list[float]] | None:
    """On every rank of a gloo job: each pattern's uplink rate (Mbit/s) per repeat; rank 0 returns them."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for connection in range(CONNECTIONS):
        for a in range(world):
            for b in range(a + 1, world):
                group = dist.new_group([a, b])
                if rank in (a, b):
                    groups[(a, b, connection)] = group
    payload = torch.zeros(int(mb * 1e6) // 4)
    landing = {peer: torch.empty_like(payload) for peer in range(world)}

    def run(phases: list[list[tuple[int, int]]], sliced: bool, connections: int) -> float:
        step = SLICE_BYTES // 4 if sliced else payload.numel()
        dist.barrier()
        start = time.perf_counter()
        for phase in phases:
            works = []
            for i, begin in enumerate(range(0, payload.numel(), step)):
                for to, source in phase:
                    c = i % connections
                    works.append(dist.irecv(landing[source][begin:begin + step], source,
                                            group=groups[(min(rank, source), max(rank, source), c)], tag=i))
                    works.append(dist.isend(payload[begin:begin + step], to,
                                            group=groups[(min(rank, to), max(rank, to), c)], tag=i))
            for work in works:
                work.wait()
        dist.barrier()
        return (world - 1) * payload.numel() * 4 * 8 / (time.perf_counter() - start) / 1e6

    rates: dict[str, list[float]] = {}
    for name, (phases, sliced, connections) in PATTERNS.items():
        # The first run of a pattern only warms its connections (TCP's windows after the previous pattern).
        rates[name] = [run(phases(rank, world), sliced, connections) for _ in range(1 + repeats)][1:]
    dist.destroy_process_group()
    return rates if rank == 0 else None


def rows_for(congestion: str, args: argparse.Namespace) -> list[dict]:
    """One emulated cluster under ``congestion``: a row per pattern."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "rates.json")
        command = [str(Path(__file__).resolve()), "--worker", str(out), "--mb", str(args.mb), "--repeats",
                   str(args.repeats)]
        result = subprocess.run(launcher(command, args.hosts, args.rate, tcp_congestion=congestion),
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the {congestion} cluster failed:\n{result.stderr[-3000:]}")
        rates = json.loads(out.read_text())
    ring = statistics.median(rates[RING])
    return [{"tcp_congestion": congestion, "pattern": name, "Mbit_per_s": statistics.median(values),
             "vs_ring": statistics.median(values) / ring, "repeats_Mbit_per_s": [round(v, 1) for v in values]}
            for name, values in rates.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each host's link, e.g. 100mbit")
    parser.add_argument("--tcp-congestion", nargs="+", default=["bbr", "cubic"],
                        help="the congestion controls to compare, one cluster each")
    parser.add_argument("--mb", type=float, default=8.0, help="MB each host sends to each other host per pattern")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)   # a rank inside the cluster
    args = parser.parse_args()
    if args.worker:
        rates = measure(args.mb, args.repeats)
        if rates is not None:
            Path(args.worker).write_text(json.dumps(rates))
        return
    rows = [row for congestion in args.tcp_congestion for row in rows_for(congestion, args)]
    save(f"link_patterns_{args.rate}", {k: v for k, v in vars(args).items() if k != "worker"}, rows,
         ["tcp_congestion", "pattern", "Mbit_per_s", "vs_ring", "repeats_Mbit_per_s"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_link_patterns() -> str:
    rows = rows_of("link_patterns_100mbit")
    return table(["TCP congestion control", "pattern", "each host's uplink", "of the ring's", "repeats"],
                 [[r["tcp_congestion"], r["pattern"], f"{r['Mbit_per_s']:.1f} Mbit/s", percent(r["vs_ring"]),
                   ", ".join(f"{v:g}" for v in r["repeats_Mbit_per_s"])] for r in rows])


BLOCKS = (
    Block("link_patterns", "How much of each link a ring and all-to-all traffic get, 4 hosts at 100 Mbit",
          ("link_patterns_100mbit",), "the ring pattern in the same cluster", render_link_patterns,
          rerun="python bench/link_patterns.py --hosts 4 --rate 100mbit --repeats 5", emulated=True),
)


if __name__ == "__main__":
    main()
