"""Run a function in N real processes joined by a gloo process group."""
from convoy.utils.spawn import free_port, run_in_processes as run_workers

__all__ = ["free_port", "run_workers"]
