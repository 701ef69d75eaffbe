"""The engine listener that checkpoints layer by layer while training goes on (seed 003).

On the engine's auxiliary thread, the moment a layer's update for a
checkpointed step is applied, ``on_layer_updated`` copies the layer
(parameters and optimizer state) into a staging buffer and queues it; a
persister thread writes each staged layer into its fixed slot of the file's
inactive area and flushes it, while the other layers are still being
exchanged and the next forward runs. When the step's last layer is durable
the commit record goes last. Each layer has two staging buffers, used in turn:
a snapshot waits only when both still hold layers not yet written
(back-pressure), so no staged layer is ever overwritten before it is persisted.

One rank per node (local rank 0, "the writer") persists the parameters, the
same on every rank in data parallelism; every rank persists its own state
(buffers, error-feedback residuals, RNG) in a small file of its own. A rank
commits step t only after the model file holds its previous checkpoint, and
the writer commits step t only after every local rank file holds t, so the
two files of every rank always share a committed step.
"""
from __future__ import annotations

import queue
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.checkpoint.format import CommitRecord, FormatError, Layout, dtype_of
from convoy.checkpoint.snapshot import layer_sources, module_buffers, rank_layout, rank_state
from convoy.checkpoint.store import AREAS, Store
from convoy.engine.listeners import Listener

_POLL_S = 0.002


class CheckpointError(RuntimeError):
    """The persister failed (disk error, a peer's file never appeared); training stops."""


def model_file(directory: Path, writer_rank: int) -> Path:
    return directory / f"model-rank{writer_rank}.ckpt"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"state-rank{rank}.ckpt"


def committed_step(path: Path) -> int:
    """The newest step whose commit record in ``path`` is intact; -1 when none (or no file)."""
    try:
        store = Store.open(path)
    except (OSError, FormatError):
        return -1
    try:
        return max(store.committed_steps(), default=-1)
    finally:
        store.close()


class CheckpointListener(Listener):
    """Checkpoints every ``every``-th step (and the last) into ``directory``.

    Args:
        directory: where the files live (created by the caller).
        model: the model the engine trains.
        engine: the engine (for its layers, optimizers and sync strategy).
        every: checkpoint after steps ``every - 1, 2 * every - 1, ...`` (counting from 0).
        last_step: also checkpoint after this step (the end of training).
        steps_per_epoch: to turn a step count into (epoch, position in the epoch).
        rank, writer_rank, local_ranks: this rank, its node's writer and the node's ranks.
        model_store: the writer's open, writable model file (``None`` on other ranks).
        model_generation, rank_generation, rank_store: where the last commits were
            (0 and ``None`` for a fresh start).
        peer_timeout_s: how long to wait for another rank's file before failing.
        full_names: the whole model's names of ``model``'s ``state_dict`` keys, when
            ``model`` is one part of it (hybrid parallelism); kept in every commit record.

    Example::

        >>> listener = CheckpointListener(Path("ckpt"), model, engine, every=1, last_step=99,
        ...                               steps_per_epoch=50, rank=0, writer_rank=0, local_ranks=[0],
        ...                               model_store=Store.create(Path("ckpt/model-rank0.ckpt"), layout))
        >>> engine.listeners.append(listener)
    """

    def __init__(self, directory: Path, model: nn.Module, engine: Any, *, every: int, last_step: int,
                 steps_per_epoch: int, rank: int, writer_rank: int, local_ranks: list[int],
                 model_store: Store | None, model_generation: int = 0, rank_generation: int = 0,
                 rank_store: Store | None = None, peer_timeout_s: float = 300.0,
                 full_names: dict[str, str] | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if (rank == writer_rank) != (model_store is not None):
            raise ValueError("exactly the writer rank needs a model store")
        self.directory = Path(directory)
        self.model, self.engine = model, engine
        self.every, self.last_step, self.steps_per_epoch = every, last_step, steps_per_epoch
        self.rank, self.writer_rank, self.local_ranks = rank, writer_rank, local_ranks
        self.model_store, self.rank_store = model_store, rank_store
        self._model_gen, self._rank_gen = model_generation, rank_generation
        self._last_rank_step = max(rank_store.committed_steps(), default=-1) if rank_store else -1
        self._timeout = peer_timeout_s
        self._full_names = full_names
        layout: Layout | None = model_store.layout if model_store is not None else None
        self._slot_of = {s.name: i for i, s in enumerate(layout.slots)} if layout else {}
        self._staging: list[list[torch.Tensor]] = []
        self._views: list[list[list[torch.Tensor]]] = []
        if layout is not None:
            for slot in layout.slots:
                bufs = [torch.empty(slot.nbytes, dtype=torch.uint8) for _ in range(2)]
                self._staging.append(bufs)
                self._views.append([[b[t.offset:t.offset + t.nbytes].view(dtype_of(t.dtype)).view(t.shape)
                                     for t in slot.tensors] for b in bufs])
        self._busy = [[False, False] for _ in self._staging]
        self._cond = threading.Condition()
        self._ends_in_flight = 0
        self._seq, self._seq_step = -1, -1
        self._buffers: dict[str, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.stats = {"stall_s": 0.0, "blocked_s": 0.0, "persist_s": 0.0, "bytes_written": 0, "commits": 0}
        self._thread = threading.Thread(target=self._persist_main, name="convoy-persister", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or step == self.last_step

    # ------------------------------------------------ engine's auxiliary thread
    def on_layer_updated(self, layer: Any, step: int) -> None:
        if not self.due(step):
            return
        start = time.perf_counter()
        self._raise_if_failed()
        if step != self._seq_step:
            self._seq, self._seq_step = self._seq + 1, step
        for name, buf in module_buffers(layer.name, layer.module):
            self._buffers[name] = buf.detach().clone()
        if self.model_store is not None:
            index, which = self._slot_of[layer.name], self._seq % 2
            blocked = self._wait(lambda: not self._busy[index][which])
            tensors, meta = layer_sources(layer.module, layer.params, self.engine.optimizers[layer.index],
                                          self.model_store.layout.slots[index])
            for dst, src in zip(self._views[index][which], tensors):
                dst.copy_(src)
            with self._cond:
                self._busy[index][which] = True
            self._queue.put(("slot", step, index, which, meta))
            self.stats["blocked_s"] += blocked
        self.stats["stall_s"] += time.perf_counter() - start

    def on_step_end(self, step: int, stats: Any) -> None:
        if not self.due(step):
            return
        start = time.perf_counter()
        state = rank_state(self.model, self.engine.sync, self._buffers)
        self._buffers = {}
        group = self.engine.optimizers[0].param_groups[0]
        extra = {"forward_order": [layer.name for layer in self.engine.layers],
                 "hyper": {k: v for k, v in group.items() if k != "params" and _jsonable(v)}}
        if self._full_names is not None:
            extra["full_names"] = self._full_names
        # At most two steps' rank state in flight: bounded memory on every rank.
        self.stats["blocked_s"] += self._wait(lambda: self._ends_in_flight < 2)
        with self._cond:
            self._ends_in_flight += 1
        self._queue.put(("end", step, state, extra))
        self.stats["stall_s"] += time.perf_counter() - start

    def _wait(self, predicate: Any) -> float:
        start = time.perf_counter()
        with self._cond:
            while not predicate():
                self._raise_if_failed()
                self._cond.wait(0.5)
        self._raise_if_failed()
        return time.perf_counter() - start

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"checkpointing failed: {self._error}") from self._error

    # --------------------------------------------------------- persister thread
    def _persist_main(self) -> None:
        checksums: dict[int, int] = {}
        metas: dict[str, Any] = {}
        try:
            while (item := self._queue.get()) is not None:
                start = time.perf_counter()
                if item[0] == "slot":
                    self._persist_slot(*item[1:], checksums, metas)
                else:
                    self._persist_end(*item[1:], checksums, metas)
                    checksums, metas = {}, {}
                self.stats["persist_s"] += time.perf_counter() - start
        except BaseException as exc:  # the auxiliary thread re-raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _persist_slot(self, step: int, index: int, which: int, meta: dict, checksums: dict, metas: dict) -> None:
        store = self.model_store
        generation = self._model_gen + 1
        if not checksums:   # first layer of this checkpoint: the area is no longer a valid one
            store.invalidate(generation % AREAS)
        data = memoryview(self._staging[index][which].numpy())
        store.write_slot(generation % AREAS, index, data, generation)
        checksums[index] = zlib.crc32(data)
        if meta:
            metas[store.layout.slots[index].name] = meta
        self.stats["bytes_written"] += len(data)
        with self._cond:
            self._busy[index][which] = False
            self._cond.notify_all()

    def _persist_end(self, step: int, state: dict, extra: dict, checksums: dict, metas: dict) -> None:
        done = step + 1
        epoch, position = divmod(done, self.steps_per_epoch)
        if self.rank != self.writer_rank:
            # Never let this file get two checkpoints ahead of the model file.
            self._await_peer(model_file(self.directory, self.writer_rank), self._last_rank_step)
        self._persist_rank_state(done, epoch, position, state)
        if self.model_store is not None:
            for peer in self.local_ranks:
                if peer != self.rank:
                    self._await_peer(rank_file(self.directory, peer), done)
            layout = self.model_store.layout
            if len(checksums) != len(layout.slots):
                raise CheckpointError(f"step {step}: {len(checksums)} of {len(layout.slots)} layers staged")
            generation = self._model_gen + 1
            record = CommitRecord(generation, done, epoch, position, [checksums[i] for i in range(len(checksums))],
                                  {"signature": layout.signature(), "optimizer_meta": metas,
                                   "time": time.time(), **extra})
            self.model_store.commit(generation % AREAS, record)
            self._model_gen = generation
            self.stats["commits"] += 1
        with self._cond:
            self._ends_in_flight -= 1
            self._cond.notify_all()

    def _persist_rank_state(self, done: int, epoch: int, position: int, state: dict) -> None:
        layout = rank_layout(state, {"rank": self.rank})
        if self.rank_store is None or self.rank_store.layout.signature() != layout.signature():
            if self.rank_store is not None:
                self.rank_store.close()
            self.rank_store = Store.create(rank_file(self.directory, self.rank), layout)
        generation = self._rank_gen + 1
        area = generation % AREAS
        self.rank_store.invalidate(area)
        flat = torch.empty(layout.slots[0].nbytes, dtype=torch.uint8)
        for spec in layout.slots[0].tensors:
            flat[spec.offset:spec.offset + spec.nbytes].view(dtype_of(spec.dtype)).view(spec.shape) \
                .copy_(state[spec.key])
        data = memoryview(flat.numpy())
        self.rank_store.write_slot(area, 0, data, generation)
        self.rank_store.commit(area, CommitRecord(generation, done, epoch, position, [zlib.crc32(data)],
                                                  {"rank": self.rank}))
        self._rank_gen, self._last_rank_step = generation, done

    def _await_peer(self, path: Path, step: int) -> None:
        deadline = time.monotonic() + self._timeout
        while committed_step(path) < step:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{path} did not reach step {step} within {self._timeout:.0f} s")
            time.sleep(_POLL_S)

    # ----------------------------------------------------------------- control
    def commit_now(self, step: int) -> None:
        """Checkpoint ``step`` although it is not due: the job stops after it (a stop signal).

        Call from the training thread once the engine has applied ``step`` on
        every layer and runs no more steps (``engine.close()``); then :meth:`close`.
        """
        if self.due(step):
            return   # already staged by the engine's callbacks
        self.last_step = step
        for layer in self.engine.layers:
            self.on_layer_updated(layer, step)
        self.on_step_end(step, None)

    def flush(self) -> None:
        """Block until everything queued so far is committed (or raise the persister's error)."""
        self._wait(lambda: self._ends_in_flight == 0 and not any(any(b) for b in self._busy))

    def close(self) -> None:
        """Persist what is queued, stop the persister and close the files."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        for store in (self.model_store, self.rank_store):
            if store is not None:
                store.close()
        self._raise_if_failed()


def _jsonable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
