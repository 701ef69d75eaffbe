"""Rebuilding a rank's state between full snapshots by replaying the logged steps.

With differential checkpoints and a compressor whose error-feedback memory is
updated from the rank's own gradient alone (``Compressor.local``), a rank's
file (residuals, velocities, buffers, RNG) is written only with the full
snapshots. A resume restores the snapshot at step k, and the training loop
runs steps k..t-1 again: the same batches, forward, backward and local
compression, so residuals, velocities, batch-norm buffers and the RNG move
exactly as they did. Only the exchange is skipped: :class:`ReplayFeed` hands
the sync strategy each bucket's averaged gradient as the log recorded it (the
gradient the bucket's optimizer saw), so parameters and momentum come out
bit-identical too.

Example::

    >>> sync.start_replay(ReplayFeed(read_updates(model_path, point)))
    >>> # training steps k..t-1 now take their averages from the log; then
    >>> sync.stop_replay()
"""
from __future__ import annotations

import torch

from convoy.checkpoint.difflog import Chunks, dense
from convoy.checkpoint.format import FormatError


class ReplayFeed:
    """The averaged gradients of the steps a resume replays, by step and bucket.

    Args:
        updates: the log's records in order (:func:`convoy.checkpoint.recovery.read_updates`);
            a record of step count n holds the update of engine step n - 1.

    Raises:
        FormatError: a record skipped layers (an fp16 overflow: replay does not apply there).
    """

    def __init__(self, updates: list[dict]):
        self._grads: dict[tuple[int, tuple[str, ...]], Chunks] = {}
        self.first = updates[0]["step"] - 1 if updates else 0
        self.end = updates[-1]["step"] if updates else 0   # the first step not replayed
        for update in updates:
            if update["skipped"]:
                raise FormatError(f"the record of step {update['step']} skipped layers {update['skipped']}")
            for bucket in update["buckets"]:
                self._grads[(update["step"] - 1, tuple(bucket.layers))] = bucket.grad

    def __call__(self, step: int, layers: tuple[str, ...]) -> torch.Tensor | None:
        """The averaged gradient of ``layers`` (a bucket, in its order) at ``step``; None past the
        replayed steps. Each is handed out once (the feed then lets go of it)."""
        if not self.first <= step < self.end:
            return None
        grad = self._grads.pop((step, layers), None)
        if grad is None:
            raise RuntimeError(f"replaying step {step}: the checkpoint's log holds no update of the bucket "
                               f"{'+'.join(layers)} (the engine's buckets differ from the run that wrote it)")
        return dense(grad)
