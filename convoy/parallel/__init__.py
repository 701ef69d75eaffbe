"""Parallel layouts: how the model and the batch are divided among ranks."""
from convoy.parallel.base import ParallelLayout
from convoy.parallel.data import DataParallel

PARALLEL_NAMES = ("data",)

__all__ = ["PARALLEL_NAMES", "DataParallel", "ParallelLayout"]
