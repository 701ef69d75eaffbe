"""``convoy trace RUN_DIR``: one Chrome trace from the timelines a ``--trace`` run wrote."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
Merge the per-rank timelines of a `convoy train --sync ps --trace` run
(RUN_DIR/trace-rank<R>.json) into RUN_DIR/trace.json: per-layer forward
compute and waits and gradient-ready marks on the workers, every slice's push
and pull on its channel, and the servers' updates. Open it in chrome://tracing
or https://ui.perfetto.dev.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trace", help="merge a --trace run's timelines into one Chrome trace",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder of a --sync ps --trace run")
    parser.add_argument("--out", metavar="FILE", help="where to write the trace (default: RUN_DIR/trace.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from convoy.ps.chrome_trace import merge_traces, summarize

    path = merge_traces(args.run_dir, args.out)
    counts = ", ".join(f"{n} {cat}" for cat, n in sorted(summarize(path).items()))
    print(f"convoy: wrote {path} ({counts})")
    return 0
