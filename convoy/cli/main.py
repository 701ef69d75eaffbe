"""The ``convoy`` command."""
from __future__ import annotations

import sys
from typing import Sequence

from convoy.cli import bench, checkpoint, plan, plot, profile_nodes, simulate, trace, train
from convoy.cli.args import Parser
from convoy.errors import UsageError, one_line
from convoy.utils.timeline import mark


def build_parser() -> Parser:
    parser = Parser(prog="convoy", description="Communication-efficient, failure-tolerant "
                    "distributed training of convolutional networks on torch.distributed.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    train.add_parser(commands)
    plot.add_parser(commands)
    checkpoint.add_parser(commands)
    bench.add_parser(commands)
    profile_nodes.add_parser(commands)
    trace.add_parser(commands)
    simulate.add_parser(commands)
    plan.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    mark("imported")   # the interpreter is up and torch and convoy are imported
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not hasattr(args, "func"):
            parser.print_help(sys.stderr)
            return 2
        return args.func(args)
    except UsageError as exc:
        print(f"convoy: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `convoy checkpoint inspect DIR | head`: the reader has gone, which is fine
        sys.stderr.close()   # nothing left to say, and a flush at exit would fail again
        return 0
