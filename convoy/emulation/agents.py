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
from convoy.runtime import QUIET_RANK_ENV

RDZV_PORT = 29400   # in the first host's namespace: its own port space
# The c10d rendezvous settings an elastic job re-forms quickly with (``--rdzv-conf``). A lost
# host leaves the rendezvous only when its keep-alive expires, ``keep_alive_interval`` x
# ``keep_alive_max_attempt`` after its last beat (torch's default 5 s x 3: the survivors waited
# 15 s of every failure for it); then the round waits ``last_call_timeout`` (torch's default 30 s)
# for more hosts once it has the fewest it takes. A waiting agent polls the rendezvous once a
# second (torch's own delay), so a last call of 2 s still takes in every survivor that noticed the
# failure within a second of the first. A live host must not be taken for dead: with beats of 1 s
# and 2 missed (2 s), an agent whose worker kept its cores busy was (docs/checkpoints.md), so a
# beat may be late by 5 s here.
FAST_RENDEZVOUS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 5, "last_call_timeout": 2}
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


def rdzv_conf(**settings: int) -> str:
    """``settings`` as ``--rdzv-conf`` takes them: ``"key=value,..."``.

    Example::

        >>> rdzv_conf(**FAST_RENDEZVOUS)
        'keep_alive_interval=1,keep_alive_max_attempt=5,last_call_timeout=2'
    """
    return ",".join(f"{key}={value}" for key, value in settings.items())


def agent_environment(env: dict[str, str] | None = None, gloo_interface: str | None = "eth0") -> dict[str, str]:
    """This process's environment for an agent and its workers, with ``env`` added.

    Args:
        env: more variables, e.g. ``{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}`` (a host that joins a
            later round of torch 2.13's rendezvous needs it).
        gloo_interface: GLOO_SOCKET_IFNAME, or None to leave it unset.
    """
    environ = {key: value for key, value in os.environ.items() if key not in _CHOSEN}
    environ.update(QUIET_RANK_ENV, **(env or {}))   # no DNS in the namespaces: c10d warns of it
    if gloo_interface:
        environ["GLOO_SOCKET_IFNAME"] = gloo_interface
    return environ
