"""Sync strategies: how a layer's local gradient becomes the gradient every rank applies."""
from convoy.sync.allreduce import AllReduce, ring_allreduce_bytes
from convoy.sync.base import PendingSync, SyncStrategy

SYNC_NAMES = ("allreduce",)

__all__ = ["SYNC_NAMES", "AllReduce", "PendingSync", "SyncStrategy", "ring_allreduce_bytes"]
