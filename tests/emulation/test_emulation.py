"""Emulated clusters: namespaces, shaped links, a job across them, and tear-down."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convoy.emulation import EmulatedCluster, Topology, leftover_namespaces, machine_congestion_control, parse_rate
from convoy.errors import UsageError
from tests.helpers import convoy, convoy_in_process

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rates_parse_like_tc_and_bad_topologies_are_refused():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9 and parse_rate("500kbit") == 500e3
    for bad in ("fast", "0mbit", "-1gbit", ""):
        with pytest.raises(UsageError, match="link rate"):
            parse_rate(bad)
    with pytest.raises(UsageError, match="must divide"):
        Topology(hosts=3, host_rate=1e6, racks=2, inter_rack_rate=1e6)
    with pytest.raises(UsageError, match="inter-rack-rate"):
        Topology(hosts=4, host_rate=1e6, racks=2)
    with pytest.raises(UsageError, match="one link rate > 0 per host"):
        Topology(hosts=2, host_rate=1e6, host_rates=(1e6,))


@pytest.mark.timeout(300)
@needs_netns
def test_a_host_on_a_slower_link_is_shaped_at_its_own_rate_both_ways():
    with EmulatedCluster(Topology(hosts=2, host_rate=25e6, host_rates=(100e6, 25e6)), tag="convoyrate") as cluster:
        def rate(prefix: list[str], dev: str) -> str:
            out = subprocess.run(prefix + ["tc", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            return out.split(" rate ")[1].split()[0]
        switch = ["ip", "netns", "exec", cluster.switch]
        assert [rate(cluster.exec_prefix(h), "eth0") for h in (0, 1)] == ["100Mbit", "25Mbit"]
        assert [rate(switch, f"h{h}") for h in (0, 1)] == ["100Mbit", "25Mbit"]


@pytest.mark.timeout(300)
@needs_netns
def test_hosts_run_the_named_congestion_control_and_the_machine_keeps_its_own():
    machine = machine_congestion_control()
    available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    other = next(name for name in available if name != machine)
    with EmulatedCluster(Topology(hosts=2, host_rate=1e9), tag="convoycc", congestion_control=other) as cluster:
        for host in (0, 1):
            read = subprocess.run(cluster.exec_prefix(host) + ["sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                                  capture_output=True, text=True).stdout.strip()
            assert read == other
    assert machine_congestion_control() == machine


@pytest.mark.timeout(300)
@needs_netns
def test_two_racks_are_built_shaped_and_removed_even_on_failure():
    topology = Topology(hosts=4, host_rate=1e9, racks=2, inter_rack_rate=50e6)
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedCluster(topology, tag="convoytest") as cluster:
            made = {cluster.host_ns(h) for h in range(4)} | {cluster.switch}
            assert made <= _namespaces()
            qdiscs = subprocess.run(["tc", "-n", cluster.switch, "qdisc", "show"],
                                    capture_output=True, text=True).stdout
            assert qdiscs.count("tbf") == 6  # 4 host ports + both ends of the inter-rack link
            assert qdiscs.count("rate 50Mbit") == 2 and qdiscs.count("rate 1Gbit") == 4
            host = subprocess.run(cluster.exec_prefix(3) + ["tc", "qdisc", "show", "dev", "eth0"],
                                  capture_output=True, text=True).stdout
            assert "rate 1Gbit" in host
            # Host 0 (rack 0) reaches host 3 (rack 1) over TCP.
            server = subprocess.Popen(cluster.exec_prefix(3) + [sys.executable, "-c", (
                "import socket; s = socket.socket(); s.bind(('198.18.0.4', 5555)); s.listen();"
                "c, _ = s.accept(); print(len(c.recv(100)))")], stdout=subprocess.PIPE, text=True)
            subprocess.run(cluster.exec_prefix(0) + [sys.executable, "-c", (
                "import socket, time\n"
                "for _ in range(50):\n"
                "    try: s = socket.create_connection(('198.18.0.4', 5555)); break\n"
                "    except OSError: time.sleep(0.1)\n"
                "s.sendall(b'hello')")], check=True, timeout=30)
            assert server.communicate(timeout=30)[0].strip() == "5"
            raise RuntimeError("inside the cluster")
    assert not made & _namespaces()


@pytest.mark.timeout(300)
@needs_netns
def test_a_training_job_runs_across_emulated_hosts(tmp_path):
    before = set(leftover_namespaces())  # another job's cluster may be up
    result = convoy("bench", "cluster", "--hosts", "2", "--rate", "1gbit", "--", "train", "--steps", "6",
                    "--no-progress", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "convoy: 6 steps in" in result.stdout
    assert (tmp_path / "run" / "metrics-rank1.jsonl").exists()
    assert set(leftover_namespaces()) <= before


@pytest.mark.timeout(300)
@needs_netns
def test_bad_cluster_input_is_one_line_and_exit_2():
    for args in (["--rate", "fast"], ["--hosts", "0"], ["--hosts", "3", "--racks", "2", "--inter-rack-rate", "1mbit"],
                 ["--tcp-congestion", "warp"]):
        result = convoy_in_process("bench", "cluster", *args, "--", "train")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert convoy_in_process("bench", "cluster", "--", "run.sh").returncode == 2


# Busy for a second of wall time; prints the CPU seconds it got and its cgroup.
_SPIN = """
import os, time
start, cpu = time.perf_counter(), time.process_time()
while time.perf_counter() - start < 1.0:
    pass
cgroup = [l for l in open('/proc/self/cgroup') if 'cpu' in l.split(':')[1].split(',') or l.startswith('0::')][0].strip()
print(os.environ['RANK'], time.process_time() - cpu, cgroup, flush=True)
"""


@pytest.mark.timeout(300)
@needs_netns
def test_a_straggler_from_the_cluster_file_gets_a_quarter_of_a_fair_cpu_share(tmp_path):
    (tmp_path / "cluster.toml").write_text('nodes = 2\nrate = "1gbit"\nspeeds = [1, 0.25]\n')
    (tmp_path / "spin.py").write_text(_SPIN)
    result = convoy("bench", "cluster", "--cluster", str(tmp_path / "cluster.toml"), "--", str(tmp_path / "spin.py"))
    assert result.returncode == 0, result.stderr
    assert "host 1 at 0.25x" in result.stdout
    lines = {int(line.split()[0]): line.split() for line in result.stdout.splitlines() if line[:1].isdigit()}
    # A fair share is 2 cores / 2 hosts per host; the cap is a quarter of that. The
    # kernel's bandwidth control never grants more, however idle the machine is.
    cap = 0.25 * len(os.sched_getaffinity(0)) / 2
    assert float(lines[1][1]) <= cap * 1.2 + 0.02
    assert lines[1][2].endswith("-h1") and not lines[0][2].endswith("-h0")
    assert not any(p.name.endswith("-h1") for p in _cgroup_dirs())   # removed on exit


def _cgroup_dirs() -> list:
    root = Path("/sys/fs/cgroup/cpu")
    return list(root.rglob("convoy*-h*")) if root.exists() else []


@pytest.mark.timeout(60)
def test_cluster_file_and_host_flags_are_not_mixed(tmp_path):
    (tmp_path / "cluster.toml").write_text('nodes = 2\nrate = "1gbit"\n')
    result = convoy("bench", "cluster", "--cluster", str(tmp_path / "cluster.toml"), "--hosts", "3", "--", "train")
    assert result.returncode == 2 and "drop --hosts" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(300)
@needs_netns
def test_cleanup_takes_only_namespaces_whose_maker_is_gone():
    import os
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    live, dead = f"convoy{os.getpid()}-t", f"convoy{gone.pid}-t"
    for name in (live, dead):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        leftover = leftover_namespaces()
        assert dead in leftover and live not in leftover   # a running cluster is never torn down
    finally:
        for name in (live, dead):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.timeout(300)
@needs_netns
def test_a_killed_host_loses_every_process_and_the_others_keep_theirs_and_their_own_cores():
    with EmulatedCluster(Topology(hosts=2, host_rate=1e9, own_cores=True), tag="convoykill") as cluster:
        sleepers = [subprocess.Popen(cluster.exec_prefix(host) + ["sleep", "60"]) for host in (0, 1, 1)]
        try:
            deadline = time.monotonic() + 30
            while sorted(len(cluster.pids(host)) for host in (0, 1)) != [1, 2]:
                assert time.monotonic() < deadline, [cluster.pids(host) for host in (0, 1)]
                time.sleep(0.05)
            on_host_1 = cluster.pids(1)
            assert sorted(cluster.kill_host(1)) == sorted(on_host_1) == sorted(p.pid for p in sleepers[1:])
            assert [p.wait(timeout=10) for p in sleepers[1:]] == [-9, -9]
            assert cluster.pids(1) == [] and sleepers[0].poll() is None
            # Every host is capped at an even share of the cores, the one with full speed too.
            share = len(os.sched_getaffinity(0)) / 2
            for host in (0, 1):
                cap = cluster.caps[host].path
                quota = (cap / "cpu.cfs_quota_us") if (cap / "cpu.cfs_quota_us").exists() else (cap / "cpu.max")
                assert int(quota.read_text().split()[0]) == int(share * 100_000)
            assert Path(f"/proc/{sleepers[0].pid}/cgroup").read_text().count("convoykill-h0") >= 1
        finally:
            for sleeper in sleepers:
                sleeper.kill()
                sleeper.wait()


@pytest.mark.timeout(120)
@needs_netns
def test_a_cluster_run_in_process_gives_back_the_callers_sigterm_handler(tmp_path):
    import signal

    from convoy.cli.main import main

    (tmp_path / "noop.py").write_text("pass\n")
    def marker(*_):
        pass

    mine = signal.signal(signal.SIGTERM, marker)
    try:
        assert main(["bench", "cluster", "--hosts", "2", "--", str(tmp_path / "noop.py")]) == 0
        assert signal.getsignal(signal.SIGTERM) is marker
    finally:
        signal.signal(signal.SIGTERM, mine)
