"""Calibrate an emulated cluster: gloo all-reduce time against the bandwidth-optimal ring.

Run one rank per emulated host:

    convoy bench cluster --hosts 4 --rate 100mbit -- bench/cluster_allreduce.py --rate 100mbit

The ring's lower bound for S bytes over N hosts on links of B bit/s is
2 (N-1)/N * S * 8 / B. With ``--busy`` a thread on every rank multiplies
matrices meanwhile, as a training step's backward does while the engine
exchanges: where hosts share the machine's cores, a ring step then also waits
for the next rank's thread to be scheduled. Rank 0 writes
bench/results/cluster_allreduce_<rate>_<N>[_busy].{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import save  # noqa: E402
from bench.figures import Block, number, rows_of, seconds, table  # noqa: E402
from convoy.emulation import parse_rate  # noqa: E402


@contextmanager
def computing(busy: bool) -> Iterator[None]:
    """A thread that keeps one core busy with one-thread matrix products (when ``busy``)."""
    stop = threading.Event()

    def multiply() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a

    thread = threading.Thread(target=multiply, daemon=True)
    if busy:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if busy:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", required=True, help="the host link rate the cluster was built with")
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="time them while every rank also computes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rows = dist.get_world_size(), []
    for size_mb in args.sizes_mb:
        tensor = torch.ones(int(size_mb * 1e6 / 4))
        dist.all_reduce(tensor)  # connect and warm up
        times = []
        with computing(args.busy):
            for _ in range(args.repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - start)
        ideal = 2 * (world - 1) / world * size_mb * 1e6 * 8 / parse_rate(args.rate)
        measured = statistics.median(times)
        rows.append({"size_MB": size_mb, "hosts": world, "rate": args.rate, "busy": args.busy, "allreduce_s": measured,
                     "ring_bound_s": ideal, "measured/bound": measured / ideal})
    if dist.get_rank() == 0:
        save(f"cluster_allreduce_{args.rate}_{world}" + ("_busy" if args.busy else ""), vars(args), rows,
             ["size_MB", "hosts", "rate", "busy", "allreduce_s", "ring_bound_s", "measured/bound"])
    dist.destroy_process_group()


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

SOURCES = ("cluster_allreduce_100mbit_4", "cluster_allreduce_100mbit_4_busy", "cluster_allreduce_1gbit_4",
           "cluster_allreduce_1gbit_4_busy")


def render_cluster_allreduce() -> str:
    rows = rows_of(*SOURCES)
    return table(["size", "hosts", "links", "ranks busy", "gloo all-reduce", "ring bound", "measured / bound"],
                 [[f"{r['size_MB']:g} MB", str(r["hosts"]), r["rate"], "yes" if r["busy"] else "no",
                   seconds(r["allreduce_s"]), seconds(r["ring_bound_s"]), number(r["measured/bound"])]
                  for r in rows])


BLOCKS = (
    Block("cluster_allreduce", "gloo all-reduce on emulated hosts", SOURCES,
          "the bandwidth-optimal ring, 2 (N - 1) / N x bytes / rate", render_cluster_allreduce,
          rerun="python bench/cluster_allreduce.py --rate 100mbit|1gbit [--busy]", emulated=True),
)


if __name__ == "__main__":
    main()
