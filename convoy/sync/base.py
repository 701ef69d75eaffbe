"""The sync-strategy interface lives in :mod:`convoy.core` (the engine and the strategies share it)."""
from convoy.core.sync import Done, PendingSync, SyncStrategy

__all__ = ["Done", "PendingSync", "SyncStrategy"]
