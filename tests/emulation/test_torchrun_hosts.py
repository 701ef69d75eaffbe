"""torchrun across two emulated hosts (network namespaces): c10d rendezvous, one agent per host.

The job equals ``convoy train --nproc 2`` bit for bit; a worker SIGKILLed under ``--max-restarts 1``
resumes from the checkpoint and ends bit for bit there too; and a host that gives gloo an address the
other cannot reach fails within --timeout with one line naming what to set.
"""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from convoy.emulation import EmulatedCluster, Topology
from tests.emulation.agents import convoy_lines as _convoy_lines, needs_namespaces, torchrun_agents
from tests.helpers import convoy_in_process, dying_model, importable, same_saved_models

pytestmark = needs_namespaces

# 5 steps an epoch on digits with 2 workers: 12 steps cross two epoch boundaries.
JOB = ("--batch-size", "128", "--lr-schedule", "constant", "--compress", "fp16", "--no-progress",
       "--eval-every", "0", "--steps", "12", "--model", "crashing:factory")
AGENT_TIMEOUT_S = 150

# LeNet plus a forward hook that SIGKILLs rank 1 at its sixth step, once (unless the marker exists).
CRASHING_MODEL = dying_model(call=6)


@pytest.fixture(scope="module")
def hosts():
    """Two hosts on a 1 Gbit/s switch; removed afterwards, whatever happened."""
    with EmulatedCluster(Topology(hosts=2, host_rate=1e9)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The model folder of ``convoy train --nproc 2`` of JOB, and the folder the model module lives in."""
    tmp = tmp_path_factory.mktemp("twohosts")
    (tmp / "crashing.py").write_text(textwrap.dedent(CRASHING_MODEL))
    (tmp / "never").touch()   # an existing marker: the hook never kills
    run = convoy_in_process("train", "--nproc", "2", *JOB, "--out", str(tmp / "reference"),
                            env={**importable(tmp), "CRASH_MARKER": str(tmp / "never")})
    assert run.returncode == 0, run.stderr
    return tmp


def _torchrun(hosts: EmulatedCluster, tmp: Path, marker: Path, out: Path, extra: tuple[str, ...] = (),
              gloo_interface: str | None = "eth0", agent: tuple[str, ...] = (),
              job: tuple[str, ...] = JOB) -> list[subprocess.CompletedProcess]:
    """One torchrun agent per host, c10d rendezvous on the first; their exit statuses and output."""
    return torchrun_agents(hosts, tmp, out.name, ["-m", "convoy", "train", *job, *extra, "--out", str(out)],
                           agent=agent, env={"CRASH_MARKER": str(marker)}, gloo_interface=gloo_interface,
                           timeout_s=AGENT_TIMEOUT_S)


@pytest.mark.timeout(400)
def test_two_torchrun_hosts_equal_nproc_2_and_a_killed_worker_resumes_bit_identically(hosts, reference):
    """Rank 1 SIGKILLs itself at step 5; both agents restart their worker, which resumes from the
    checkpoint. The steps before the crash and after the restart all run across the two hosts, so
    ending on the nproc 2 model bit for bit says both that two hosts train as nproc 2 and that the
    restart resumed exactly; the slow test below tells the two apart (a run without the crash)."""
    tmp = reference
    agents = _torchrun(hosts, tmp, tmp / "crashed", tmp / "restarted", ("--checkpoint-dir", str(tmp / "ckpt")),
                       agent=("--max-restarts", "1"))
    assert all(a.returncode == 0 for a in agents), _convoy_lines(agents)
    assert (tmp / "crashed").exists()
    assert "resumed from" in "".join(a.stderr for a in agents)
    same_saved_models(tmp / "reference", tmp / "restarted")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_torchrun_hosts_without_a_crash_equal_nproc_2(hosts, reference):
    """The two-host job of the test above without its crash (with -m slow): a difference it shows
    lies in the two-host run itself, not in the restart."""
    tmp = reference
    agents = _torchrun(hosts, tmp, tmp / "never", tmp / "whole")
    assert all(a.returncode == 0 for a in agents), _convoy_lines(agents)
    same_saved_models(tmp / "reference", tmp / "whole")


@pytest.mark.timeout(400)
def test_a_powersgd_job_killed_on_one_host_resumes_inside_its_log_on_both_bit_identically(hosts, reference):
    """PowerSGD writes the rank files every step and the model files' logs between full snapshots, so
    both hosts resume inside a log; each writer then waits for the other's model file to hold that
    step before its first checkpoint. The other host's step travels through the store: it must be
    the step its log reached, not its snapshot's, or both wait for each other until --timeout."""
    tmp = reference
    job = tuple("powersgd" if arg == "fp16" else arg for arg in JOB)
    run = convoy_in_process("train", "--nproc", "2", *job, "--out", str(tmp / "reference-powersgd"),
                            env={**importable(tmp), "CRASH_MARKER": str(tmp / "never")})
    assert run.returncode == 0, run.stderr
    agents = _torchrun(hosts, tmp, tmp / "crashed-powersgd", tmp / "restarted-powersgd",
                       ("--checkpoint-dir", str(tmp / "ckpt-powersgd"), "--timeout", "30"),
                       agent=("--max-restarts", "1"), job=job)
    said = _convoy_lines(agents)
    assert all(a.returncode == 0 for a in agents), said
    assert (tmp / "crashed-powersgd").exists()
    assert "differential steps replayed" in said, said   # resumed inside the log, as the test means to
    same_saved_models(tmp / "reference-powersgd", tmp / "restarted-powersgd")


@pytest.mark.timeout(300)
def test_a_host_name_the_other_host_cannot_reach_fails_within_the_timeout_with_one_line(hosts, reference):
    """No GLOO_SOCKET_IFNAME: gloo gives the peer the address of the host's name, which resolves to
    loopback or to the machine's own address, outside the other namespace's reach."""
    tmp = reference
    agents = _torchrun(hosts, tmp, tmp / "never", tmp / "unreachable", ("--timeout", "5"), gloo_interface=None)
    assert all(agent.returncode != 0 for agent in agents)
    lines = [[line for line in agent.stderr.splitlines() if line.startswith("convoy:")] for agent in agents]
    assert all(len(said) == 1 for said in lines), _convoy_lines(agents)
    failed = [said[0] for said in lines if "could not connect to every other rank within 5 s (--timeout)" in said[0]]
    # The first host to fail ends the rendezvous; the other agent may then stop its worker first.
    assert failed and all(said[0] in failed or said[0].endswith("before training started") for said in lines), \
        _convoy_lines(agents)
    assert all("GLOO_SOCKET_IFNAME" in line and "--local-addr" in line for line in failed), failed
