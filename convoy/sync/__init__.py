"""Sync strategies: how a layer's local gradient becomes the gradient every rank applies.

The ``--sync`` choices (these, and ps, which lays out its job itself) are registered in
:mod:`convoy.train.strategies`.
"""
from convoy.sync.allreduce import AllReduce, ring_allreduce_bytes
from convoy.sync.base import PendingSync, SyncStrategy
from convoy.sync.hierarchical import Hierarchical
from convoy.sync.pipeline import CompressionPipeline

__all__ = ["AllReduce", "CompressionPipeline", "Hierarchical", "PendingSync", "SyncStrategy", "ring_allreduce_bytes"]
