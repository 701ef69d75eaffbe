"""A duty cycle on a command: ``python -m convoy.emulation.dutycycle SHARE -- COMMAND...``.

COMMAND runs SHARE of every PERIOD_S and is stopped (SIGSTOP, with every
process it started) for the rest, so its computation and its replies both slow
down, as on a slower or busier machine (an emulated straggler host).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

PERIOD_S = 0.1


def _signal_tree(root: psutil.Process, signum: int) -> None:
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:   # it ended
        return
    for process in tree:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def duty_cycle(share: float, argv: list[str]) -> int:
    """Run ``argv``, letting it (and its children) run ``share`` of every PERIOD_S; return its exit status.

    The launcher signals a rank's whole process group, so a stop signal reaches the
    command too: this process then lets it run again and waits for it to end.
    """
    child = subprocess.Popen(argv)
    root = psutil.Process(child.pid)
    stopping: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        while child.poll() is None and not stopping:
            time.sleep(share * PERIOD_S)
            _signal_tree(root, signal.SIGSTOP)
            time.sleep((1.0 - share) * PERIOD_S)
            _signal_tree(root, signal.SIGCONT)
    finally:
        _signal_tree(root, signal.SIGCONT)
    return child.wait()


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m convoy.emulation.dutycycle SHARE -- COMMAND...", file=sys.stderr)
        return 2
    return duty_cycle(float(args[0]), args[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
