"""The persister: a background thread that writes what the listener hands it, at the lowest priority.

The listener (:mod:`convoy.checkpoint.listener`) sends typed messages: a
:class:`LayerWrite` for each layer of a full snapshot, written straight from
the tensors it carries (one ``pwritev`` per half layer, no staging copy) into
the layer's fixed slot in the file's inactive area; a :class:`StepEnd` when a
step is over, which makes the area durable (one fdatasync) and commits it, or
appends the step's update to the differential log. A layer handed over live
(copy-on-write in time rather than in memory) is *held* until its bytes are
read; the listener's optimizer pre-hook waits on :meth:`Persister.wait_released`.

Every rank writes its own state (buffers, error-feedback residuals, RNG) in a
small file of its own. A rank commits step t only after the model file holds
its previous checkpoint, and the writer commits step t only after every local
rank file holds t, so the two files of every rank always share a committed
step; a writer waits likewise for the other model files, on this machine and
(through the job's store) on others.

Example::

    >>> persister = Persister(CheckpointFiles(Path("ckpt"), rank=0, writer_rank=0, local_ranks=[0],
    ...                                       model_store=store), steps_per_epoch=50, differential=False,
    ...                       stats=listener.stats)
    >>> persister.hand_over(LayerWrite(step, slot, tensors, meta), live=True)
    >>> persister.end_step(StepEnd(step, {}, checkpoint=True, state=state, extra=extra, full=True))
    >>> persister.close()
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from convoy.checkpoint import difflog
from convoy.checkpoint.arena import RankArena
from convoy.checkpoint.difflog import DiffLog, log_path
from convoy.checkpoint.files import PeerFile, RemoteWriter, committed_step, model_file, rank_file
from convoy.checkpoint.format import CommitRecord
from convoy.checkpoint.snapshot import rank_layout
from convoy.checkpoint.store import AREAS, Store
from convoy.compress import Place
from convoy.utils.threads import PERSISTER_THREAD_NICE, lower_priority

# First and longest sleep while waiting for a peer's file: a peer's commit is on the path of
# every checkpoint (the writer's commit of step t waits for the ranks' files of t, theirs of t + 1
# for the writer's of t), so a long sleep past it delays the next one; a poll costs ~0.1 ms.
_POLL_S = (0.001, 0.01)
ENDS_IN_FLIGHT = 2   # at most two steps' rank state queued: bounded memory on every rank


class CheckpointError(RuntimeError):
    """The persister failed (disk error, a peer's file never appeared); training stops."""


@dataclass(frozen=True)
class CheckpointFiles:
    """Where one rank's checkpoints go, and whose files it keeps pace with.

    Args:
        directory: where the files live (created by the caller).
        rank, writer_rank, local_ranks: this rank, its node's writer and the node's ranks.
        model_store: the writer's open, writable model file (``None`` on other ranks).
        rank_store, model_generation, rank_generation: where the last commits were
            (``None`` and 0 for a fresh start).
        other_writers: the other model files' writers in ``directory`` (hybrid groups,
            colocated shards, clusters), whose files must keep a step in common with this one.
        remote_writers, peer_store: writers on other machines, followed through the job's store.
        peer_timeout_s: how long to wait for another rank's file before failing.
    """

    directory: Path
    rank: int
    writer_rank: int
    local_ranks: Sequence[int]
    model_store: Store | None
    rank_store: Store | None = None
    model_generation: int = 0
    rank_generation: int = 0
    other_writers: Sequence[int] = ()
    remote_writers: Sequence[int] = ()
    peer_store: Any = None
    peer_timeout_s: float = 300.0


@dataclass(frozen=True)
class LayerWrite:
    """A writer's layer at a checkpointed ``step``: ``tensors`` go to the model file's slot ``slot``."""

    step: int
    slot: int
    tensors: list[torch.Tensor]
    meta: dict[str, Any]


@dataclass(frozen=True)
class RankImage:
    """The arena image ``image`` that a step's residuals went to; ``complete``: all of them
    did, so the image is written as it is."""

    arena: RankArena
    image: int
    complete: bool


@dataclass(frozen=True)
class StepEnd:
    """``step`` is over. Not a ``checkpoint``: only the writer's log record of ``updates``.

    A checkpoint writes ``state`` to the rank file (``None``: not at this one),
    then the writer commits the model file: a ``full`` snapshot (its layers came
    as :class:`LayerWrite`, ``extra`` goes into the commit record) or the
    step's ``updates`` appended to the log.
    """

    step: int
    updates: dict[str, difflog.BucketUpdate | None] = field(default_factory=dict)
    checkpoint: bool = False
    state: dict[str, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    full: bool = False
    image: RankImage | None = None


class Persister:
    """Writes one rank's checkpoint files on a thread of its own.

    Args:
        files: the files and the peers.
        steps_per_epoch: to turn a step count into (epoch, position in the epoch).
        differential: full snapshots start a differential log that updates are appended to.
        job: what the records say of the job (its world size, global batch).
        stats: the listener's counters, which this thread adds to: ``persist_s``, ``persist_cpu_s``,
            ``state_cpu_s``, ``log_cpu_s``, ``full_cpu_s``, ``update_cpu_s``, ``bytes_written``,
            ``commits``, ``full``, ``differential``.
        place_state: has the sync strategy build its residuals where a given function places
            them, straight into the rank file's images (``SyncStrategy.place_state_in``; ``None``:
            always staged).
        current_step: the step the engine's auxiliary thread is in (where a residual belongs).
    """

    def __init__(self, files: CheckpointFiles, *, steps_per_epoch: int, differential: bool,
                 stats: dict[str, float], job: dict[str, Any] | None = None,
                 place_state: Callable[[Place | None], None] | None = None,
                 current_step: Callable[[], int] = lambda: 0):
        if (files.rank == files.writer_rank) != (files.model_store is not None):
            raise ValueError("exactly the writer rank needs a model store")
        self.files = files
        self.directory, self.rank = Path(files.directory), files.rank
        self.model_store, self.rank_store = files.model_store, files.rank_store
        self.steps_per_epoch, self.differential = steps_per_epoch, differential
        self.stats = stats
        self._job = dict(job or {})
        self._model_gen, self._rank_gen = files.model_generation, files.rank_generation
        self._last_rank_step = max(self.rank_store.committed_steps(), default=-1) if self.rank_store else -1
        self._last_model_step = max(self.model_store.committed_steps(), default=-1) if self.model_store else -1
        # Writers on other machines (torchrun on several hosts): kept within one checkpoint of this
        # one through the job's store, as those on this machine are through their files.
        self._remote = ([RemoteWriter(files.peer_store, w) for w in files.remote_writers]
                        if files.peer_store is not None else [])
        # What the other machines' writers wait for is the step this file can restore, its log
        # included, as a local peer reads it (PeerFile): resumed inside a log, the snapshot's step
        # alone would hold every writer of a job that writes rank files each step (PowerSGD)
        # waiting for the others' model files at its first checkpoint, until --timeout.
        self._publish(committed_step(self.model_store.path) if self.model_store is not None else -1)
        self._log: DiffLog | None = None                    # the differential log being appended to
        self._place_state, self._current_step = place_state, current_step
        self._arena: RankArena | None = None
        self._arena_store: Store | None = None   # the rank store the arena mirrors
        self._peers: dict[Path, PeerFile] = {}
        self._cond = threading.Condition()
        self._held = [False] * (len(self.model_store.layout.slots) if self.model_store else 0)
        self._ends_in_flight = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="convoy-persister", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- training side
    @property
    def arena(self) -> RankArena | None:
        """The images this rank's residuals go to, once the rank file's layout is known."""
        return self._arena

    def hand_over(self, write: LayerWrite, live: bool) -> None:
        """Queue ``write``; ``live``: its tensors are the training ones, held until read."""
        if live:
            with self._cond:
                self._held[write.slot] = True
        self._queue.put(write)

    def end_step(self, end: StepEnd) -> float:
        """Queue ``end``, once fewer than ``ENDS_IN_FLIGHT`` are; returns the seconds waited."""
        waited = self._wait(lambda: self._ends_in_flight < ENDS_IN_FLIGHT)
        with self._cond:
            self._ends_in_flight += 1
        self._queue.put(end)
        return waited

    def held(self, slots: Sequence[int]) -> bool:
        return any(self._held[slot] for slot in slots)

    def wait_released(self, slots: Sequence[int]) -> float:
        """Block until the persister has read ``slots``' live tensors; returns the seconds waited."""
        return self._wait(lambda: not self.held(slots))

    def drain(self) -> None:
        """Block until every queued step end is written (or raise the persister's error)."""
        self._wait(lambda: self._ends_in_flight == 0)

    def flush(self) -> None:
        """Block until everything queued so far is committed (or raise the persister's error)."""
        self._wait(lambda: self._ends_in_flight == 0 and not any(self._held))

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"checkpointing failed: {self._error}") from self._error

    def close(self) -> None:
        """Persist what is queued, stop the thread and close the files."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._place_state is not None:
            self._place_state(None)
        for store in (self.model_store, self.rank_store):
            if store is not None:
                store.close()
        for peer in self._peers.values():
            peer.close()
        if self._log is not None:
            self._log.close()
        self.raise_if_failed()

    def _wait(self, predicate: Callable[[], bool]) -> float:
        start = time.perf_counter()
        with self._cond:
            while not predicate():
                self.raise_if_failed()
                self._cond.wait(0.5)
        self.raise_if_failed()
        return time.perf_counter() - start

    # -------------------------------------------------------- persister thread
    def _main(self) -> None:
        lower_priority(PERSISTER_THREAD_NICE)
        checksums: dict[int, int] = {}
        metas: dict[str, Any] = {}
        try:
            while (item := self._queue.get()) is not None:
                start, cpu = time.perf_counter(), time.thread_time()
                if isinstance(item, LayerWrite):
                    self._write_layer(item, checksums, metas)
                else:
                    self._end(item, checksums, metas)
                    checksums, metas = {}, {}
                self.stats["persist_s"] += time.perf_counter() - start
                used = time.thread_time() - cpu
                self.stats["persist_cpu_s"] += used
                full = isinstance(item, LayerWrite) or item.full
                self.stats["full_cpu_s" if full else "update_cpu_s"] += used
        except BaseException as exc:  # the training side re-raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _write_layer(self, write: LayerWrite, checksums: dict[int, int], metas: dict[str, Any]) -> None:
        store, index = self.model_store, write.slot
        generation = self._model_gen + 1
        area = generation % AREAS
        if not checksums:   # first layer of this checkpoint: the area is no longer a valid one
            for writer in self._other_model_files():
                # The area holds this file's older step: another model file must hold the newer one
                # before it goes, or a crash now would leave no step that every file holds.
                self._await_peer(writer, self._last_model_step)
            store.invalidate(area)
            if self.differential:   # this area's log extended the snapshot being overwritten
                DiffLog.start(log_path(store.path, area), generation, write.step + 1).close()
        released = []

        def release() -> None:
            # Once only: after it the layer's next update may run and hand over its next checkpoint,
            # whose hold a second release would drop before that checkpoint is read.
            if not released:
                released.append(True)
                with self._cond:
                    self._held[index] = False
                    self._cond.notify_all()
        try:
            # The layer is released as soon as its bytes are copied, not after the write to the disk.
            checksums[index] = store.write_tensors(area, index, write.tensors, generation, read=release)
        finally:
            release()
        if write.meta:
            metas[store.layout.slots[index].name] = write.meta
        self.stats["bytes_written"] += store.layout.slots[index].nbytes

    def _end(self, end: StepEnd, checksums: dict[int, int], metas: dict[str, Any]) -> None:
        done = end.step + 1
        if not end.checkpoint:   # a step between checkpoints: only the writer's log record
            self._commit_update(done, end.updates, checkpoint=False)
        else:
            epoch, position = divmod(done, self.steps_per_epoch)
            if end.state is not None:
                self._persist_own_file(done, epoch, position, end.state, end.image)
            if self.model_store is not None:
                if end.state is not None:   # with replay, rank files are written with the full snapshots only
                    for peer in self.files.local_ranks:
                        if peer != self.rank:
                            self._await_peer(rank_file(self.directory, peer), done)
                if end.full:
                    self._commit_full(done, epoch, position, end.extra, checksums, metas)
                else:
                    self._commit_update(done, end.updates)
        with self._cond:
            self._ends_in_flight -= 1
            self._cond.notify_all()

    def _persist_own_file(self, done: int, epoch: int, position: int, state: dict[str, torch.Tensor],
                          image: RankImage | None) -> None:
        if self.rank != self.files.writer_rank:
            # Never let this file get two checkpoints ahead of the model file.
            self._await_peer(model_file(self.directory, self.files.writer_rank), self._last_rank_step)
        for writer in self._other_model_files():
            # Nor a model file two checkpoints ahead of another: each keeps two, and a
            # resume needs a step every file holds.
            self._await_peer(writer, self._last_rank_step)
        try:
            self._persist_rank_state(done, epoch, position, state, image)
        finally:
            if image is not None:
                image.arena.end_write(image.image)

    def _commit_full(self, done: int, epoch: int, position: int, extra: dict[str, Any], checksums: dict[int, int],
                     metas: dict[str, Any]) -> None:
        layout = self.model_store.layout
        if len(checksums) != len(layout.slots):
            raise CheckpointError(f"step {done - 1}: {len(checksums)} of {len(layout.slots)} layers staged")
        generation = self._model_gen + 1
        area = generation % AREAS
        self.model_store.flush(area)   # every layer durable before the record that vouches for them
        record = CommitRecord(generation, done, epoch, position, [checksums[i] for i in range(len(checksums))],
                              {"signature": layout.signature(), "optimizer_meta": metas,
                               "time": time.time(), **extra})
        self.model_store.commit(area, record)
        self._model_gen, self._last_model_step = generation, done
        self._publish(done)
        if self.differential:
            if self._log is not None:
                self._log.close()
            self._log = DiffLog.reopen(log_path(self.model_store.path, area), generation, done, done)
        self.stats["commits"] += 1
        self.stats["full"] += 1

    def _commit_update(self, done: int, updates: dict[str, difflog.BucketUpdate | None],
                       checkpoint: bool = True) -> None:
        layout = self.model_store.layout
        if len(updates) != len(layout.slots) or self._log is None:
            raise CheckpointError(f"step {done - 1}: {len(updates)} of {len(layout.slots)} layer updates kept")
        cpu = time.thread_time()
        buckets = list({id(u): u for u in updates.values() if u is not None}.values())
        skipped = [name for name, update in updates.items() if update is None]
        self.stats["bytes_written"] += self._log.append(done, difflog.pack(done, buckets, skipped))
        self._publish(done)
        self.stats["log_cpu_s"] += time.thread_time() - cpu
        self.stats["commits"] += checkpoint
        self.stats["differential"] += checkpoint

    def _persist_rank_state(self, done: int, epoch: int, position: int, state: dict[str, torch.Tensor],
                            image: RankImage | None = None) -> None:
        """Write this rank's file, from ``image`` as it is where it holds the whole state."""
        cpu = time.thread_time()
        # The residuals are rewritten whole every step: a CRC-32 of them would cost more than
        # writing them. The commit protocol already vouches that a committed area is complete.
        layout = rank_layout(state, {"rank": self.rank, "checksum": "pagesum"})
        if self.rank_store is None or self.rank_store.layout.signature() != layout.signature():
            if self.rank_store is not None:
                self.rank_store.close()
            self.rank_store = Store.create(rank_file(self.directory, self.rank), layout)
        if self._arena_store is not self.rank_store:
            self._build_arena()
        generation = self._rank_gen + 1
        area = generation % AREAS
        self.rank_store.invalidate(area)
        if image is not None and image.complete and image.arena is self._arena:
            checksum = self.rank_store.write_image(area, 0, image.arena.fill(image.image, state), generation)
        else:
            checksum = self.rank_store.write_tensors(area, 0, [state[spec.key] for spec in layout.slots[0].tensors],
                                                     generation)
        self.rank_store.flush(area)
        self.rank_store.commit(area, CommitRecord(generation, done, epoch, position, [checksum],
                                                  {"rank": self.rank, **self._job}))
        self.stats["bytes_written"] += layout.slots[0].nbytes
        self.stats["state_cpu_s"] += time.thread_time() - cpu
        self._rank_gen, self._last_rank_step = generation, done

    def _build_arena(self) -> None:
        """Have the sync strategy put its residuals into images of the rank file's slot, where the
        file takes them as they are (page sums, O_DIRECT); else keep staging them."""
        self._arena, self._arena_store = None, self.rank_store
        if self._place_state is not None and self.rank_store.can_write_images() and any(
                spec.key.startswith("sync.residual.") for spec in self.rank_store.layout.slots[0].tensors):
            arena = RankArena(self.rank_store.layout.slots[0])
            self._place_state(lambda key, like: arena.place("sync." + key, like, self._current_step()))
            self._arena = arena
        elif self._place_state is not None:
            self._place_state(None)

    def _other_model_files(self) -> list[Path | RemoteWriter]:
        """The other writers' model files: paths on this machine, store keys for other machines'."""
        return [model_file(self.directory, writer) for writer in self.files.other_writers] + self._remote

    def _publish(self, step: int) -> None:
        if self.files.peer_store is not None and self.model_store is not None:
            RemoteWriter.publish(self.files.peer_store, self.files.writer_rank, step)

    def _await_peer(self, where: Path | RemoteWriter, step: int) -> None:
        deadline = time.monotonic() + self.files.peer_timeout_s
        pause = _POLL_S[0]
        peer = where if isinstance(where, RemoteWriter) else self._peers.setdefault(where, PeerFile(where))
        while peer.committed_step() < step:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{peer.describe()} did not reach step {step} within "
                                      f"{self.files.peer_timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
