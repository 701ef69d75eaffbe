"""Parallel layouts: how the model and the batch are divided among ranks."""
from convoy.parallel.base import ParallelLayout
from convoy.parallel.data import DataParallel
from convoy.parallel.hybrid import HybridParallel, HybridRoles

PARALLEL_NAMES = ("data", "hybrid")

__all__ = ["PARALLEL_NAMES", "DataParallel", "HybridParallel", "HybridRoles", "ParallelLayout"]
