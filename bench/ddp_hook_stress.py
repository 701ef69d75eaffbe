"""Many short two-process gloo DDP jobs per comm hook: does any hang or abort?

Each run is a real pair of fresh interpreters (the abort this looks for happens while a
process exits), joined by a gloo group on loopback, training a small conv net whose
2048x256 linear layer gives DDP's default buckets (1 MB first, then 25 MB) more than one
bucket, for a few steps with ``convoy.ddp.comm_hook(NAME)``. A run that has not ended
within ``--timeout`` seconds is a hang (both processes are killed); one that ends by a
signal or prints "terminate called" is an abort; any other non-zero exit is a failure.

    python bench/ddp_hook_stress.py --runs 50 --hooks blocktopk powersgd fp16 topk
    python bench/ddp_hook_stress.py --runs 12 --hooks blocktopk --options block_fraction=1.0

Prints a table (a row per hook: ok / hang / abort / failed), writes it to
bench/results/ddp_hook_stress.json (``--tag`` adds to the name), and exits 1 if any run did
not end cleanly.
"""
from __future__ import annotations

import argparse
import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.figures import Block, rows_of, table  # noqa: E402


def stress_net():
    """A conv net with a 2048x256 linear layer: 1x16x16 in, 10 classes out."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def train_job(hook: str | None, options: dict, steps: int, seed: int = 0, keep: list | None = None):
    """One DDP job in this (already joined) process: ``steps`` steps of the conv net with ``hook``.

    Returns the flat parameters at the end. DDP's default buckets; the process group is the
    default one. The data is random and the same for a given seed on every run. ``keep``, if
    given, receives the DDP model (alive as long as the list is).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import convoy

    rank = dist.get_rank()
    torch.manual_seed(seed)   # the same initial model on every rank
    model = DistributedDataParallel(stress_net())
    if hook is not None:
        model.register_comm_hook(*convoy.ddp.comm_hook(hook, **options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 1, 16, 16, generator=data), torch.randint(0, 10, (16,), generator=data)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    if keep is not None:
        keep.append(model)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# The DDP model of a run that ends with it alive (--end model): dropped only as the interpreter exits.
_KEPT: list = []


def _worker(hook: str | None, options: dict, steps: int, end: str) -> None:
    """One rank of a run, as a user's script would be: join, train, end as ``end`` says."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_job(hook, options, steps, keep=_KEPT if end == "model" else None)
    if end == "destroy":
        dist.destroy_process_group()
    # end == "exit": the process group is still alive when the interpreter exits;
    # end == "model": the DDP model (its reducer, the hook's state) too.


def _parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(hook: str, options: list[str], steps: int, end: str, timeout: float) -> tuple[str, str]:
    """Launch one two-process job; return (outcome, the stderr of a run that did not end cleanly)."""
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                  os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--worker", hook, "--steps", str(steps), "--end", end, "--options", *options]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in range(2)]
    deadline = time.monotonic() + timeout
    outcome, errors = "ok", []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            outcome = "hang"
            for p in procs:   # each run's processes are in sessions of their own: end them all
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            err = proc.communicate()[1]
        errors.append(err)
        if outcome == "hang":
            continue
        if proc.returncode < 0 or "terminate called" in err:
            outcome = "abort"
        elif proc.returncode != 0 and outcome == "ok":
            outcome = "failed"
    return outcome, "" if outcome == "ok" else "\n".join(e.strip()[-2000:] for e in errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="HOOK", help=argparse.SUPPRESS)
    parser.add_argument("--hooks", nargs="+", default=["blocktopk", "powersgd", "fp16", "topk"],
                        help="hook names (none: DDP's own all-reduce)")
    parser.add_argument("--options", nargs="*", default=[], help="every hook's options, key=value")
    parser.add_argument("--runs", type=int, default=50, help="jobs per hook")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--end", choices=("exit", "model", "destroy"), default="exit",
                        help="how a rank ends: exit with the process group alive, also with the DDP model "
                             "alive, or destroy the group first")
    parser.add_argument("--verbose", action="store_true", help="a line per run on stderr")
    parser.add_argument("--tag", default="", help="suffix of the result's name (results/ddp_hook_stress_TAG.json)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take before it is a hang")
    args = parser.parse_args(argv)
    options = dict(_parse_option(o) for o in args.options)
    if args.worker:
        _worker(None if args.worker == "none" else args.worker, options, args.steps, args.end)
        return 0
    bad, rows = 0, []
    for hook in args.hooks:
        counts: dict[str, int] = {"ok": 0, "hang": 0, "abort": 0, "failed": 0}
        start = time.monotonic()
        for run in range(args.runs):
            began = time.monotonic()
            outcome, err = run_once(hook, args.options, args.steps, args.end, args.timeout)
            counts[outcome] += 1
            if args.verbose or outcome != "ok":
                print(f"  {hook} run {run}: {outcome} ({time.monotonic() - began:.0f} s)" + (f"\n{err}" if err else ""),
                      file=sys.stderr, flush=True)
        bad += args.runs - counts["ok"]
        rows.append({"hook": hook, "runs": args.runs, **counts, "seconds": round(time.monotonic() - start, 1)})
    from bench.common import save

    settings = {"options": args.options, "steps": args.steps, "end": args.end, "timeout_s": args.timeout}
    save("ddp_hook_stress" + (f"_{args.tag}" if args.tag else ""), settings, rows,
         ["hook", "runs", "ok", "hang", "abort", "failed", "seconds"])
    return 1 if bad else 0


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_ddp_hook_stress() -> str:
    return table(["hook", "runs", "ended cleanly", "hung", "aborted", "failed"],
                 [[r["hook"], str(r["runs"]), str(r["ok"]), str(r["hang"]), str(r["abort"]), str(r["failed"])]
                  for r in rows_of("ddp_hook_stress")])


BLOCKS = (
    Block("ddp_hook_stress", "DDP comm hooks: fresh two-process gloo jobs that must all end cleanly",
          ("ddp_hook_stress",), "no peer: the bar is zero hangs and aborts", render_ddp_hook_stress,
          rerun="python bench/ddp_hook_stress.py --runs 50 --hooks blocktopk powersgd fp16 topk --timeout 120"),
)


if __name__ == "__main__":
    sys.exit(main())
