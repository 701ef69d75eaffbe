"""Step accounting lives in :mod:`convoy.core`; kept here for old imports."""
from convoy.core.stats import StepStats

__all__ = ["StepStats"]
