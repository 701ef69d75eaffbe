"""Sync strategies: how a layer's local gradient becomes the gradient every rank applies."""
from convoy.sync.allreduce import AllReduce, ring_allreduce_bytes
from convoy.sync.base import PendingSync, SyncStrategy
from convoy.sync.hierarchical import Hierarchical
from convoy.sync.pipeline import CompressionPipeline

SYNC_NAMES = ("allreduce", "hierarchical", "ps")  # ps: strategies in convoy.ps, laid out by convoy.parallel.ps

__all__ = ["SYNC_NAMES", "AllReduce", "CompressionPipeline", "Hierarchical", "PendingSync", "SyncStrategy", "ring_allreduce_bytes"]
