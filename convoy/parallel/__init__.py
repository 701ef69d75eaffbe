"""Parallel layouts: how the model and the batch are divided among ranks.

The ``--parallel`` choices are registered in :mod:`convoy.train.layouts`.
"""
from convoy.parallel.base import ParallelLayout
from convoy.parallel.data import DataParallel
from convoy.parallel.hybrid import HybridParallel, HybridRoles

__all__ = ["DataParallel", "HybridParallel", "HybridRoles", "ParallelLayout"]
