"""How the parameter server's helper threads report a failure to the threads that wait on them."""
from __future__ import annotations

from convoy.core import Waiter


class PSError(RuntimeError):
    """Parameter-server training cannot go on: a peer died or a transfer failed."""


def _raise_ps_error(message: str, cause: BaseException | None) -> None:
    raise PSError(message) from cause


def ps_waiter() -> Waiter:
    """A :class:`~convoy.core.Waiter` whose failures raise :class:`PSError`."""
    return Waiter(_raise_ps_error)
