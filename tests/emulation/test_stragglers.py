"""Slow hosts of an emulated cluster: the cluster file, and the duty cycle that slows a host's CPU."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from convoy.emulation import Stragglers
from convoy.errors import UsageError

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(time.process_time() - t)"


def test_a_cluster_file_names_slow_hosts(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('[hosts.3]\ncpu = 0.25\n[hosts.1]\nrate = "25mbit"\n')
    slow = Stragglers.read(str(path), 4)
    assert slow.cpu == {3: 0.25} and slow.rate == {1: 25e6}
    assert slow.command(0, ["x"]) == ["x"]
    assert slow.command(3, ["x"])[-3:] == ["0.25", "--", "x"]


@pytest.mark.parametrize("text, expected", [
    ("[hosts.4]\ncpu = 0.5\n", "[hosts.4] is not a host of 0..3"),
    ("[hosts.0]\ncpu = 0\n", "cpu must be in (0, 1]"),
    ("[hosts.0]\ncpu = 1.5\n", "cpu must be in (0, 1]"),
    ("[hosts.0]\nspeed = 1\n", "valid keys: cpu, rate"),
    ("[hosts.0]\nrate = \"fast\"\n", "bad link rate 'fast'"),
    ("[racks]\n", "unknown table 'racks'"),
])
def test_a_bad_cluster_file_is_one_usage_error(tmp_path, text, expected):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=None) as error:
        Stragglers.read(str(path), 4)
    assert expected in str(error.value)


@pytest.mark.timeout(120)
def test_the_duty_cycle_stretches_a_busy_command_and_keeps_its_exit_status():
    def wall(*prefix: str) -> float:
        start = time.monotonic()
        result = subprocess.run([*prefix, sys.executable, "-c", BUSY], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return time.monotonic() - start

    free = wall()
    throttled = wall(sys.executable, "-m", "convoy.emulation.dutycycle", "0.2", "--")
    # 0.3 s of CPU at a fifth of each period takes >= 1.5 s; the interpreters' start-up adds to both.
    assert throttled - free > 0.9
    failing = subprocess.run([sys.executable, "-m", "convoy.emulation.dutycycle", "0.5", "--", sys.executable,
                              "-c", "raise SystemExit(3)"])
    assert failing.returncode == 3
