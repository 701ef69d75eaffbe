"""Joining the job: process group set-up from torchrun's environment variables.

Start-up cannot hang: the store and the peers are reached within the timeout
or the process fails with one line naming what to set, and a stop signal
ends it at once while it waits (the waiting happens in a helper thread; the
main thread only sleeps in short slices, so its signal handlers run).
Under torchrun's shared agent store, every (re)start of the workers builds
its process group on a store of its own, so a restart never reads the keys
of the workers it replaces.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from convoy.errors import StartupFailed, UsageError

_ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Set by convoy's own launcher: rank 0's rendezvous store listens on MASTER_ADDR
# only (127.0.0.1 locally), where torch's default would listen on every interface.
BIND_STORE_ENV = "CONVOY_BIND_STORE"
# What the ranks convoy starts find in their environment unless it says otherwise.
# c10d logs a peer's closed connection (the rank that failed has exited) and a
# host name without DNS (an emulated host) as warnings with a C++ stack, which
# would bury the failed rank's one-line report: its ranks log errors only. torch
# reads this when it is imported, so it must be set before the rank imports it.
QUIET_RANK_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
# Set by torchrun's agent when MASTER_ADDR:MASTER_PORT is its own store, which
# outlives the workers and so keeps every key that earlier workers wrote.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_NONCE_KEY = "convoy/nonce"
_POLL_S = 0.05
# Seconds start-up and every collective wait for a peer before the job fails, unless given.
DEFAULT_TIMEOUT_S = 300.0

@dataclass(frozen=True)
class Context:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def launched_by_torchrun() -> bool:
    """True when the rendezvous variables of torchrun (or convoy's launcher) are set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE"))


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Context:
    """Initialise the default process group from RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    Without those variables this is a world of one (no process group is made).
    gloo on CPU, NCCL when CUDA is available, unless ``backend`` says otherwise.
    Under ``torchrun --max-restarts N`` restarted workers join without any
    extra variable (see :func:`_attempt_store`).

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``None`` for the default of the device.
        timeout_s: how long a collective may wait for a peer before failing;
            a worker that dies makes the others fail within this bound. Start-up
            is bounded by it too: a store or peer that cannot be reached raises
            :class:`~convoy.errors.StartupFailed`, whose one line names what to set.

    Example::

        >>> ctx = convoy.init()
        >>> print(ctx.rank, ctx.world_size)
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if not launched_by_torchrun():
        return Context(0, 1, 0, device, backend)
    missing = [k for k in _ENV_NEEDED if k not in os.environ]
    if missing:
        raise UsageError(f"environment lacks {', '.join(missing)}; run under torchrun or convoy train --nproc N")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _join(backend, timeout_s)
    return Context(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


class _Joining:
    """A start-up in a helper thread: the stage it reached, and how it ended."""

    def __init__(self, backend: str, timeout_s: float):
        self.backend, self.timeout_s = backend, timeout_s
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.addr, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.deadline = time.monotonic() + timeout_s
        self.stage = "store"   # then "rank0" (agent store only: rank 0's store of this attempt), "peers"
        self.error: BaseException | None = None

    def left(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.deadline - time.monotonic(), 0.001))

    def run(self) -> None:
        try:
            store = self._store()
            self.stage = "peers"
            dist.init_process_group(_device_backends(self.backend), store=store, rank=self.rank, world_size=self.world,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
            self.stage = "done"
        except BaseException as exc:   # handed to the main thread, which raises it
            self.error = exc

    def _store(self) -> dist.Store:
        if os.environ.get(BIND_STORE_ENV):
            return _bound_store(self.rank, self.world, self.left())
        if self.rank == 0 and os.environ.get(AGENT_STORE_ENV) != str(True):
            # As env:// does, but without waiting here for the others: a missing peer is reported as one.
            return dist.TCPStore(self.addr, self.port, self.world, True, self.left(), wait_for_workers=False)
        _wait_reachable(self.addr, self.port, self.deadline)
        store = dist.TCPStore(self.addr, self.port, self.world, False, self.left())
        if os.environ.get(AGENT_STORE_ENV) == str(True):
            self.stage = "rank0"
            store = _attempt_store(store, self)
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return store

    def failure(self) -> StartupFailed:
        """The one line for a start-up that did not finish in time: what was awaited, and what to set."""
        within = f"within {self.timeout_s:g} s (--timeout)"
        where = f"{self.addr}:{self.port}"
        if self.stage == "store":
            return StartupFailed(
                f"rank {self.rank} could not reach the rendezvous store at {where}{_resolves(self.addr)} {within}; "
                "if that is not an address of the store's host that this host can reach, start torchrun with "
                "--local-addr ADDRESS on every host (an address the other hosts reach) and set GLOO_SOCKET_IFNAME "
                "to its interface")
        if self.stage == "rank0":
            return StartupFailed(
                f"rank {self.rank} reached the store at {where} but rank 0 did not publish its process-group store "
                f"{within}; check that rank 0's host is up and reaches the store, and that every host's torchrun "
                "has the same --rdzv-id")
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        if interface:
            cause = (f"GLOO_SOCKET_IFNAME={interface} gives the other ranks this host's address on {interface}: "
                     "check that every host sets it to an interface the others reach")
        else:
            host = socket.gethostname()
            cause = (f"without GLOO_SOCKET_IFNAME gloo gives the other ranks the address of this host's name "
                     f"{host}{_resolves(host)}, which they may not reach: set GLOO_SOCKET_IFNAME to the interface "
                     "of an address they reach (and torchrun --local-addr to that address)")
        return StartupFailed(f"rank {self.rank} could not connect to every other rank {within}; {cause}")


def _device_backends(backend: str) -> str:
    """NCCL for CUDA tensors and gloo beside it for CPU ones: the bookkeeping collectives (scores,
    flags, sparse rows coded on the host) stay on the CPU while gradients cross over NCCL."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _join(backend: str, timeout_s: float) -> None:
    """Make the default process group, within ``timeout_s``; stop signals are obeyed meanwhile."""
    joining = _Joining(backend, timeout_s)
    helper = threading.Thread(target=joining.run, name="convoy-join", daemon=True)
    helper.start()
    # Short waits: the main thread's signal handlers (a stop signal) run between them. On a
    # timeout the helper stays blocked in torch's C++; the process is about to end anyway.
    while helper.is_alive() and time.monotonic() < joining.deadline:
        helper.join(0.1)
    if helper.is_alive():
        raise joining.failure()
    error = joining.error
    if error is not None:
        if joining.stage != "done" and isinstance(error, (dist.DistError, TimeoutError)):
            raise joining.failure() from error
        if joining.stage == "peers" and "connectFullMesh" in str(error):   # gloo gave up first
            # Its reason names the address the peer gave, e.g. "Connection refused, remote=[127.0.0.1]:42405".
            reason = str(error).splitlines()[0].rsplit("] ", 1)[-1][:200]
            raise StartupFailed(f"{joining.failure()} (gloo: {reason})") from error
        raise error


def _resolves(name: str) -> str:
    """`` (NAME resolves to ADDRESS here)`` for a host name; nothing for an address."""
    try:
        ipaddress.ip_address(name)
        return ""
    except ValueError:
        pass
    try:
        return f" ({name} resolves to {socket.gethostbyname(name)} here)"
    except OSError:
        return f" ({name} does not resolve here)"


def _wait_reachable(addr: str, port: int, deadline: float) -> None:
    """Return once ``addr:port`` accepts a connection; give up silently at ``deadline`` (the caller explains).

    A plain socket, because torch's store client logs a C++ backtrace on every failed try.
    """
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{addr}:{port} did not accept a connection")
        try:
            with socket.create_connection((addr, port), timeout=min(left, 5.0)):
                return
        except OSError:
            time.sleep(min(_POLL_S * 4, max(deadline - time.monotonic(), 0)))


def _attempt_store(agent: dist.Store, joining: _Joining) -> dist.TCPStore:
    """A store for this start of the workers alone, found through torchrun's agent store.

    The agent's store outlives the workers: after a restart it still holds the keys
    the previous workers wrote (gloo's addresses among them), and a restarted rank
    reads those stale addresses and fails to connect. TORCHELASTIC_RESTART_COUNT
    cannot name a fresh key space, as it counts the restarts of each host's agent
    alone. So rank 0 starts a store of its own (as torchrun does without the shared
    store) and publishes its port and a random nonce under one agent key; the other
    ranks take the published store only when it answers with that nonce. A store
    of an earlier start is gone with its rank 0 (refused), or its port now serves
    another store (a different nonce): they read the key again until it names this
    start's store.
    """
    key = f"convoy/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/store"
    if joining.rank == 0:
        own = dist.TCPStore(joining.addr, 0, None, True, joining.left(), wait_for_workers=False)
        nonce = uuid.uuid4().hex
        own.set(_NONCE_KEY, nonce)
        agent.set(key, f"{own.port} {nonce}")
        return own
    while True:
        agent.set_timeout(joining.left())
        port, nonce = agent.get(key).decode().split()
        own = _probe(joining.addr, int(port), nonce, joining.left())
        if own is not None:
            return own
        if time.monotonic() >= joining.deadline:
            raise TimeoutError("rank 0 did not publish this start's store")
        time.sleep(_POLL_S)


def _probe(addr: str, port: int, nonce: str, timeout: datetime.timedelta) -> dist.TCPStore | None:
    """The store at ``addr:port`` if it is up and holds ``nonce``, else None."""
    try:
        with socket.create_connection((addr, port), timeout=min(timeout.total_seconds(), 5.0)):
            pass
    except OSError:
        return None   # an earlier start's rank 0 is gone, and its store with it
    try:   # briefly: the port may now belong to something else that never answers
        store = dist.TCPStore(addr, port, None, False, min(timeout, datetime.timedelta(seconds=5)))
        if store.check([_NONCE_KEY]) and store.get(_NONCE_KEY).decode() == nonce:
            store.set_timeout(timeout)
            return store
    except dist.DistError:
        pass
    return None


def _bound_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT; on rank 0 it listens on that address alone."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    listener = socket.create_server((host, port), reuse_port=False, backlog=max(128, world))
    # detach: the store owns the descriptor now; Python must not close it under the store's thread
    return dist.TCPStore(host, port, world, True, timeout, master_listen_fd=listener.detach())


def shutdown() -> None:
    """Leave the job cleanly: wait for every rank, then close the process group.

    Without it each process tears its connections down whenever it exits,
    while a slower peer may still be sending; gloo then aborts that peer.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
