"""Listeners: code the engine calls as layers and steps become final."""
from __future__ import annotations

from typing import Any

from convoy.core.stats import StepStats


class Listener:
    """Receives events from the engine's auxiliary thread.

    Both methods run on the auxiliary thread, in layer order, and delay the next
    layer's synchronisation while they run: keep them short (copy, then hand
    slow work to a thread of your own).

    Example::

        >>> class PrintSteps(Listener):
        ...     def on_step_end(self, step, stats):
        ...         print(step, stats.bytes_sent)
    """

    def on_layer_updated(self, layer: Any, step: int) -> None:
        """``layer``'s parameters and optimizer state for ``step`` are final."""

    def on_step_end(self, step: int, stats: StepStats) -> None:
        """Every layer of ``step`` is updated; ``stats`` holds its bytes."""
