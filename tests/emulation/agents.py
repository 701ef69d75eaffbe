"""torchrun agents on emulated hosts (network namespaces): what the torchrun tests share.

One agent per host, c10d rendezvous served by the first host's agent; every
agent and its workers are SIGKILLed when the test is done with them, whatever
happened, and the namespaces go with the module's cluster.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from convoy.emulation import EmulatedCluster
from convoy.emulation.agents import agent_command, agent_environment
from tests.helpers import importable, require_timeout

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None
    or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0,
    reason="emulated hosts need root and `ip netns` (iproute2)")


def start_agent(hosts: EmulatedCluster, host: int, cwd: Path, run_id: str, entry: list[str], *, nnodes: str = "2",
                agent: tuple[str, ...] = (), rdzv_conf: str = "", env: dict[str, str] | None = None,
                gloo_interface: str | None = "eth0") -> subprocess.Popen:
    """Start ``torchrun ... entry`` with one worker on ``host`` (see :func:`convoy.emulation.agents.agent_command`).

    Args:
        run_id: the rendezvous id (one per job).
        entry: what torchrun starts, e.g. ``["-m", "convoy", "train", ...]``.
        nnodes: torchrun's ``--nnodes`` (``"MIN:MAX"`` for an elastic job).
        agent: more torchrun options, e.g. ``("--max-restarts", "1")``.
        rdzv_conf: more ``--rdzv-conf`` settings, ``"key=value,..."``.
        env: more environment variables for the agent and its workers (``cwd`` is importable).
        gloo_interface: GLOO_SOCKET_IFNAME, or None to leave it unset.
    """
    require_timeout("starts torchrun agents")
    argv = agent_command(hosts, host, run_id, entry, nnodes=nnodes, agent=agent, rdzv_conf=rdzv_conf)
    environ = agent_environment({**importable(cwd), **(env or {})}, gloo_interface)
    return subprocess.Popen(argv, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish_agents(agents: list[subprocess.Popen], timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Wait for ``agents``; their exit statuses and output. Any still running after ``timeout_s``
    (or when this fails) is SIGKILLed with its process group."""
    done = []
    try:
        for agent_process in agents:
            stdout, stderr = agent_process.communicate(timeout=timeout_s)
            done.append(subprocess.CompletedProcess(agent_process.args, agent_process.returncode, stdout, stderr))
    finally:
        for agent_process in agents:   # a failed test leaves no agent or worker behind
            kill_agent(agent_process)
    return done


def kill_agent(agent: subprocess.Popen) -> None:
    """SIGKILL ``agent`` and its process group, if it still runs."""
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def torchrun_agents(hosts: EmulatedCluster, cwd: Path, run_id: str, entry: list[str], *, timeout_s: float = 150,
                    **options: object) -> list[subprocess.CompletedProcess]:
    """Run ``torchrun ... entry`` with one worker on every host of ``hosts`` (options as
    :func:`start_agent`); their exit statuses and output."""
    agents: list[subprocess.Popen] = []
    try:
        for host in range(hosts.topology.hosts):
            agents.append(start_agent(hosts, host, cwd, run_id, entry, **options))
    except BaseException:
        for agent_process in agents:
            kill_agent(agent_process)
        raise
    return finish_agents(agents, timeout_s)


def convoy_lines(agents: list[subprocess.CompletedProcess]) -> str:
    """What convoy's workers said on each host (torchrun's own reports are long and say less)."""
    return "\n".join(f"host {host}: {line}" for host, agent in enumerate(agents)
                     for line in agent.stderr.splitlines() if line.startswith("convoy"))
