"""``convoy checkpoint``: inspect a checkpoint directory, or export it as a plain torch file."""
from __future__ import annotations

import argparse
from typing import Any

_DESCRIPTION = """\
Look at or convert the checkpoints that `convoy train --checkpoint-dir DIR` writes.

  inspect DIR          both areas of every file: step, epoch, generation,
                       valid or what is damaged; file sizes; the file system
                       and whether it is DAX (persistent memory)
  export DIR OUT.pt    the newest valid step as {"model": state_dict,
                       "optimizers": [...], "step", "epoch"}: torch.load reads it
"""


def add_parser(subparsers: Any) -> None:
    """Register ``checkpoint inspect`` and ``checkpoint export``."""
    parser = subparsers.add_parser("checkpoint", help="inspect or export a checkpoint directory",
                                   description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    inspect = commands.add_parser("inspect", help="describe both areas of every checkpoint file")
    inspect.add_argument("directory", metavar="DIR")
    inspect.set_defaults(func=run_inspect)
    export = commands.add_parser("export", help="write the newest valid step as a plain torch file")
    export.add_argument("directory", metavar="DIR")
    export.add_argument("out", metavar="OUT.pt")
    export.set_defaults(func=run_export)


def run_inspect(args: argparse.Namespace) -> int:
    import sys

    from convoy.checkpoint.inspect import describe_directory, recoverable_step

    print(describe_directory(args.directory))
    step = recoverable_step(args.directory)
    if step is None:   # non-zero, so a script never mistakes damaged files for a checkpoint
        print(f"convoy: error: nothing recoverable in {args.directory}: no step is valid in every file",
              file=sys.stderr, flush=True)
        return 1
    print(f"recoverable: step {step}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from convoy.checkpoint.export import export_checkpoint

    result = export_checkpoint(args.directory, args.out)
    print(f"{args.out}: step {result['step']}, {len(result['model'])} tensors, "
          f"{len(result['optimizers'])} layer optimizers")
    return 0
