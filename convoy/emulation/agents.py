"""torchrun agents on emulated hosts: one agent per host, c10d rendezvous served by the first host's agent.

An elastic job (``--nnodes MIN:MAX``) on emulated hosts is a torchrun agent
started on each host (:meth:`EmulatedCluster.exec_prefix`); the agents find
each other through the c10d store that the first host's agent serves, and
re-form the job when a host is lost or joins. Losing the first host loses that
store, and with it the job: a job that must survive it needs a rendezvous
outside the hosts (etcd), which these emulated clusters do not have.

Example::

    >>> with EmulatedCluster(Topology(hosts=2, host_rate=1e9)) as cluster:
    ...     agents = [subprocess.Popen(agent_command(cluster, host, "job", ["-m", "convoy", "train"],
    ...                                              nnodes="1:2"), env=agent_environment())
    ...               for host in range(2)]
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from convoy.emulation.netns import EmulatedCluster

RDZV_PORT = 29400   # in the first host's namespace: its own port space
# Variables of this process that must not leak into an agent's: they are chosen per job here.
_CHOSEN = ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def agent_command(cluster: EmulatedCluster, host: int, run_id: str, entry: Sequence[str], *, nnodes: str = "2",
                  agent: Sequence[str] = (), rdzv_conf: str = "") -> list[str]:
    """The command that starts ``torchrun ... entry`` with one worker on ``host``.

    Args:
        cluster: the emulated hosts.
        host: where the agent runs.
        run_id: the rendezvous id (one per job).
        entry: what torchrun starts, e.g. ``["-m", "convoy", "train", ...]``.
        nnodes: torchrun's ``--nnodes`` (``"MIN:MAX"`` for an elastic job).
        agent: more torchrun options, e.g. ``("--max-restarts", "1")``.
        rdzv_conf: more ``--rdzv-conf`` settings, ``"key=value,..."``.
    """
    first = cluster.topology.address(0)
    # The first host serves the rendezvous: torchrun guesses so only from the machine's host name.
    conf = ",".join(filter(None, [f"is_host={int(host == 0)}", rdzv_conf]))
    return [*cluster.exec_prefix(host), sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first}:{RDZV_PORT}",
            "--rdzv-id", run_id, "--local-addr", cluster.topology.address(host), *agent, "--rdzv-conf", conf,
            *entry]


def agent_environment(env: dict[str, str] | None = None, gloo_interface: str | None = "eth0") -> dict[str, str]:
    """This process's environment for an agent and its workers, with ``env`` added.

    Args:
        env: more variables, e.g. ``{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}`` (a host that joins a
            later round of torch 2.13's rendezvous needs it).
        gloo_interface: GLOO_SOCKET_IFNAME, or None to leave it unset.
    """
    environ = {key: value for key, value in os.environ.items() if key not in _CHOSEN}
    # The namespaces have no DNS; c10d warns about it on every connection.
    environ.update(TORCH_CPP_LOG_LEVEL="ERROR", **(env or {}))
    if gloo_interface:
        environ["GLOO_SOCKET_IFNAME"] = gloo_interface
    return environ
