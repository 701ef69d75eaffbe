"""Slow hosts: a CPU bandwidth cap per emulated host, from a cgroup's CFS quota.

A straggler is a host that computes slower than the others. Namespaces share
the machine's cores, so a host is made ``speed`` times as fast as the others
by capping its processes at ``speed`` times an even share of the cores
(``cores / hosts``): every period (100 ms) the kernel lets its threads run for
that much CPU time, then holds them until the next. The cap is made in a new
cgroup below this process's own (so a benchmark's own CPU priority still
holds), and removed on exit.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from convoy.errors import UsageError

PERIOD_US = 100_000
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup() -> tuple[Path, bool]:
    """This process's cgroup directory for the cpu controller, and whether it is cgroup v2."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return _V1_ROOT / path.lstrip("/"), False
        if hierarchy == "0" and (_V2_ROOT / "cgroup.controllers").exists():
            return _V2_ROOT / path.lstrip("/"), True
    raise UsageError("a slower host needs the cgroup cpu controller, which this machine does not mount")


class CpuCap:
    """A cgroup whose processes get at most ``cores`` CPU cores of time.

    Args:
        name: the cgroup's directory name (unique on the machine).
        cores: CPU time per wall second, in cores (0.125: an eighth of one core).

    Example::

        >>> with CpuCap("convoy123-h3", cores=0.125) as cap:
        ...     subprocess.run(cap.prefix() + ["python", "train.py"])
    """

    def __init__(self, name: str, cores: float):
        if not cores > 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.cores = cores
        parent, self._v2 = _own_cgroup()
        self.path = parent / name

    def __enter__(self) -> "CpuCap":
        quota = max(1000, int(self.cores * PERIOD_US))
        try:
            self.path.mkdir()
            if self._v2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            self.remove()
            raise UsageError(f"cannot cap a host's CPU in {self.path}: {exc.strerror or exc}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def prefix(self) -> list[str]:
        """Prefix a command with this to run it (and its children) under the cap."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def remove(self) -> None:
        """Delete the cgroup once its processes are gone (they leave it as they exit); never raises."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:   # busy: a process still exiting
                time.sleep(0.1)
