"""Listeners live in :mod:`convoy.core` (the strategies implement them too); kept here for old imports."""
from convoy.core.listeners import Listener

__all__ = ["Listener"]
