"""Measured steps to a target accuracy, so ``convoy plan`` can rank by time to accuracy.

A strategy that halves the step time but needs four times the steps loses, and
the simulator alone cannot see that. Steps to a target accuracy do not depend
on the link: every strategy of the comparison suite (bench/suite.py) needed the
same steps at 100 Mbit and at 1 Gbit. So steps measured once, on whatever cluster is at hand,
times the simulator's step time predict the time to accuracy on another link.
They do depend on the model, the batch per worker and the number of workers
(the global batch), which the file records and plan checks.

convoy's compressors can send their first steps dense (``--warmup-steps``);
when the runs did, the file says how many, and those steps are counted at the
dense all-reduce's step time.

The file (JSON)::

    {"model": "resnet18", "batch_size": 16, "nodes": 4, "target": 0.97, "warmup_steps": 20,
     "runs": [{"flags": "--compress fp16", "steps_to_target": 50},
              {"flags": ["--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "2"],
               "steps_to_target": 100},
              {"flags": "--compress blocktopk --block-fraction 0.01", "steps_to_target": null}]}

``flags`` are the ``convoy train`` flags that select the strategy (what plan
prints); ``null`` steps: the run ended without reaching the target.
``model``, ``batch_size``, ``nodes``, ``target`` and ``warmup_steps`` (0) are optional;
other keys (a run's ``measured_at``, say) are ignored.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from convoy.errors import UsageError
from convoy.sim.catalog import from_flags
from convoy.sim.cpu import CpuCosts
from convoy.sim.strategies import LayerRing, Strategy


@dataclass(frozen=True)
class Convergence:
    """Steps to the target per strategy label (``None``: measured, never reached).

    Example::

        >>> c = Convergence({"allreduce fp16": 50}, model="resnet18", warmup_steps=20)
        >>> c.time_to_target(LayerRing(Compression("fp16")), step_s=1.0, dense_step_s=2.0)
        70.0
    """

    steps: dict[str, int | None]
    flags: dict[str, list[str]] = field(default_factory=dict)
    model: str | None = None
    batch_size: int | None = None
    nodes: int | None = None
    target: float | None = None
    warmup_steps: int = 0

    def time_to_target(self, strategy: Strategy, step_s: float, dense_step_s: float) -> float | None:
        """Predicted seconds to the target (None: steps not measured or never reached).

        Args:
            step_s: the strategy's predicted step.
            dense_step_s: a warm-up step's: the dense all-reduce's, or for a sparse
                compressor's density ramp its step at the ramp's mean density.
        """
        count = self.steps.get(strategy.label)
        if not count:
            return None
        dense = min(count, self.warmup_steps) if self.warms_up(strategy) else 0
        return dense * dense_step_s + (count - dense) * step_s

    def warms_up(self, strategy: Strategy) -> bool:
        """Whether the runs sent this strategy's first steps dense: its command needs ``warmup_flags()``."""
        return self.warmup_steps > 0 and isinstance(strategy, LayerRing) and strategy.compression.name != "none"

    def warmup_flags(self) -> list[str]:
        return ["--warmup-steps", str(self.warmup_steps)]

    def strategies(self, nodes: int, costs: CpuCosts | None = None) -> list[Strategy]:
        """The measured strategies, predicted with this machine's ``costs``."""
        return [from_flags(flags, nodes, costs) for flags in self.flags.values()]

    def check(self, model: str, batch_size: int, nodes: int) -> None:
        """Raise UsageError when the steps were measured on another model, batch or number of nodes."""
        for what, measured, planned in (("model", self.model, model), ("batch size", self.batch_size, batch_size),
                                        ("number of nodes", self.nodes, nodes)):
            if measured is not None and measured != planned:
                raise UsageError(f"the steps to target were measured with {what} {measured}, the plan is for "
                                 f"{planned}; steps depend on the model and the global batch, so measure them "
                                 f"with the same {what}")


def load_convergence(path: str | Path, nodes: int) -> Convergence:
    """Read a steps-to-target file (see the module doc); ``nodes`` resolves the strategies' defaults.

    Raises:
        UsageError: missing or unreadable file, a run without flags or with steps that are not a positive integer.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"steps-to-target file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read steps-to-target file {path}: {exc}") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise UsageError(f"steps-to-target file {path} needs a non-empty list \"runs\" of "
                         "{\"flags\": ..., \"steps_to_target\": ...}")
    steps: dict[str, int | None] = {}
    flags: dict[str, list[str]] = {}
    for i, run in enumerate(runs):
        run_flags, count = _run(run, i, path)
        label = from_flags(run_flags, nodes).label
        steps[label], flags[label] = count, run_flags
    try:
        convergence = Convergence(steps, flags, _optional(data, "model", str),
                                  _optional(data, "batch_size", int), _optional(data, "nodes", int),
                                  _optional(data, "target", float), _optional(data, "warmup_steps", int) or 0)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad steps-to-target file {path}: {exc}") from None
    if convergence.warmup_steps < 0:
        raise UsageError(f"warmup_steps in {path} must be >= 0, got {convergence.warmup_steps}")
    return convergence


def _optional(data: dict, key: str, cast: type) -> object:
    return None if data.get(key) is None else cast(data[key])


def _run(run: object, i: int, path: Path) -> tuple[list[str], int | None]:
    if not isinstance(run, dict) or "flags" not in run or "steps_to_target" not in run:
        raise UsageError(f"run {i} of {path} needs \"flags\" and \"steps_to_target\", got {run!r}")
    flags = shlex.split(run["flags"]) if isinstance(run["flags"], str) else [str(f) for f in run["flags"]]
    count = run["steps_to_target"]
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise UsageError(f"run {i} of {path}: steps_to_target must be a positive integer or null, got {count!r}")
    return flags, count
