"""Training jobs from a configuration: the loop, the layouts it builds, metrics and scoring.

Importing the package registers the built-in ``--sync`` strategies and ``--parallel``
layouts (:mod:`convoy.train.builtins`), so every reader of a job's config finds them.
"""
from convoy.train import builtins  # noqa: F401  (registers the built-ins)
