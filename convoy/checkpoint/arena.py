"""Page-aligned images of a rank file's state slot that the error-feedback memory writes into.

A rank's residuals are rewritten whole every step and checkpointed every
step. Without an arena the persister copies them into a page-aligned staging
buffer (``O_DIRECT`` needs one) and sums the copy; with one, the memory puts
each new residual straight at its offset in an image of the slot (it was told
where with ``Memory.place_in``), so the persister copies only the small
tensors (buffers, RNG) into the image, sums it and writes it as it is: one
pass over the residuals instead of two.

An image holds the residuals of one step. It is reused only when they are no
longer live (the next step has ended, so its memory has read them) and no
longer being written to the disk. Three images cover the step being computed,
the step before it (live until the current one ends) and the one being
persisted; when none is free the step's residuals are new tensors and its
checkpoint is staged as before.

Example::

    >>> arena = RankArena(store.layout.slots[0])
    >>> memory.place_in(lambda key, like: arena.place("sync." + key, like, step))
"""
from __future__ import annotations

import mmap
import threading

import torch

from convoy.checkpoint.format import PAGE, Slot, align, dtype_of

IMAGES = 3
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)   # Linux: map the pages in at once


class RankArena:
    """``IMAGES`` page-aligned, zero-padded images of ``slot`` (a rank file's only slot).

    Args:
        slot: the slot the images mirror: every tensor at its offset, zeros between.
    """

    def __init__(self, slot: Slot):
        self.slot = slot
        self.length = align(slot.nbytes, PAGE)
        self._specs = {spec.key: spec for spec in slot.tensors}
        # Faulted in now (the persister builds the arena) rather than by the first steps that
        # place residuals in them: three residual-sized images cost resnet18's first timed
        # steps ~0.1 s of page faults on the training path.
        self._maps = [mmap.mmap(-1, self.length, flags=mmap.MAP_SHARED | _POPULATE) for _ in range(IMAGES)]
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._step: list[int | None] = [None] * IMAGES     # the step whose residuals an image holds
        self._writing = [False] * IMAGES                  # handed to the persister, not yet written
        self._of_step: dict[int, int | None] = {}          # step -> its image (None: no image was free)
        self._ended = -1                                   # the last step that ended
        self._lock = threading.Lock()

    def place(self, key: str, like: torch.Tensor, step: int) -> torch.Tensor | None:
        """Where ``key``'s new tensor of ``step`` goes: a view of the step's image shaped like
        ``like``; None when the slot has no such tensor or no image is free for the step, or
        ``like`` lives on a GPU (its residuals stay there; the snapshot copies them over)."""
        spec = self._specs.get(key)
        if spec is None or like.device.type != "cpu" or list(like.shape) != spec.shape or dtype_of(spec.dtype) != like.dtype:
            return None
        with self._lock:
            if step not in self._of_step:
                free = [i for i in range(IMAGES) if self._step[i] is None and not self._writing[i]]
                self._of_step[step] = free[0] if free else None
                if free:
                    self._step[free[0]] = step
            image = self._of_step[step]
        if image is None:
            return None
        return self._view(image, spec.offset, spec.nbytes).view(like.dtype).view(like.shape)

    def hold(self, step: int) -> int | None:
        """Keep the image ``step``'s tensors went to (None if none) from reuse until
        :meth:`end_write`: a checkpoint of the step is about to read them, from the image or
        staged, and a later step must not write into them first."""
        with self._lock:
            image = self._of_step.get(step)
            if image is not None:
                self._writing[image] = True
        return image

    def holds(self, image: int, state: dict[str, torch.Tensor]) -> bool:
        """Whether ``state`` is the slot's and every residual of it lies in ``image`` at its own
        offset: then the image, once :meth:`fill` ed, is the slot (else the state is staged)."""
        if [spec.key for spec in self.slot.tensors] != list(state):
            return False
        base = self._bytes[image].data_ptr()
        return all(tensor.data_ptr() == base + self._specs[key].offset
                   for key, tensor in state.items() if key.startswith("sync.residual."))

    def fill(self, image: int, state: dict[str, torch.Tensor]) -> memoryview:
        """Copy the tensors of ``state`` not already in ``image`` to their offsets; the image's bytes."""
        base = self._bytes[image].data_ptr()
        for key, tensor in state.items():
            spec = self._specs[key]
            if tensor.data_ptr() != base + spec.offset and spec.nbytes:
                target = self._view(image, spec.offset, spec.nbytes)
                target.copy_(tensor.detach().reshape(-1).contiguous().view(torch.uint8))
        return memoryview(self._maps[image])

    def end_write(self, image: int) -> None:
        with self._lock:
            self._writing[image] = False
            self._retire()

    def step_ended(self, step: int) -> None:
        """``step`` ended: images of steps before it hold no live residuals any more."""
        with self._lock:
            self._ended = step
            for old in [s for s in self._of_step if s < step]:
                del self._of_step[old]
            self._retire()

    def _retire(self) -> None:
        for i in range(IMAGES):
            if self._step[i] is not None and self._step[i] < self._ended and not self._writing[i]:
                self._step[i] = None

    def _view(self, image: int, offset: int, nbytes: int) -> torch.Tensor:
        return self._bytes[image][offset:offset + nbytes]
