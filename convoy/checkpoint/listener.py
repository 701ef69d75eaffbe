"""The engine listener that checkpoints layer by layer while training goes on.

On the engine's auxiliary thread, the moment a layer's update for a
checkpointed step is applied, ``on_layer_updated`` hands the layer to a
persister thread, which writes its parameters and optimizer state straight
from the live tensors (one ``pwritev`` per half layer, no staging copy) into
the layer's fixed slot in the file's inactive area, while the other layers
are still being exchanged and the next forward runs. Nothing is copied on the
training path: the layer's next update waits (an optimizer step pre-hook) until
the persister has read it, which with a full step of slack it almost always
has (copy-on-write in time rather than in memory). When the step's last layer
is written one fdatasync makes the area durable, and the commit record goes
last. The persister runs at the lowest CPU priority, so on a machine with few
cores its copies and checksums yield to the training threads.

With gradient compression (``differential``) most checkpoints are
differential: a full snapshot every ``full_every`` checkpoints, and between
them each step's exchanged (sparse) update, appended to the snapshot's log
(:mod:`convoy.checkpoint.difflog`); recovery replays it bit for bit. Where a
rank can rebuild its own state alone (``replay``), the rank files are written
only with the full snapshots and a resume trains the logged steps again
(:mod:`convoy.checkpoint.replay`).

``every="auto"`` measures a few steps without and with checkpoints, then
checkpoints as often as keeps the measured cost within ``budget`` of a step
(CheckFreq's policy); every rank adopts the largest interval any rank chose.

One rank per node (local rank 0, "the writer") persists the parameters, the
same on every rank in data parallelism; every rank persists its own state
(buffers, error-feedback residuals, RNG) in a small file of its own. A rank
commits step t only after the model file holds its previous checkpoint, and
the writer commits step t only after every local rank file holds t, so the
two files of every rank always share a committed step.
"""
from __future__ import annotations

import math
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from convoy.checkpoint import difflog
from convoy.checkpoint.arena import RankArena
from convoy.checkpoint.difflog import DiffLog, log_path, read_chain
from convoy.checkpoint.format import CommitRecord, FormatError, Layout
from convoy.checkpoint.snapshot import layer_sources, module_buffers, rank_layout, rank_state
from convoy.checkpoint.store import AREAS, Store
from convoy.engine.listeners import Listener
from convoy.utils.threads import PERSISTER_THREAD_NICE, lower_priority

# First and longest sleep while waiting for a peer's file: a peer's commit is on the path of
# every checkpoint (the writer's commit of step t waits for the ranks' files of t, theirs of t + 1
# for the writer's of t), so a long sleep past it delays the next one; a poll costs ~0.1 ms.
_POLL_S = (0.001, 0.01)
AUTO_PROBE_STEPS = (4, 3)    # auto: steps measured without, then with checkpoints
DEFAULT_BUDGET = 0.03        # auto: the share of step time checkpoints may cost (CheckFreq's 3.5%)
DEFAULT_FULL_EVERY = "auto"  # differential: a full snapshot every this many checkpoints, or from the budget
# differential, auto: the interval until the first full snapshot's cost is known, and the longest
# (a resume by replay trains up to this many steps again)
FULL_EVERY_BOUNDS = (10, 100)


class CheckpointError(RuntimeError):
    """The persister failed (disk error, a peer's file never appeared); training stops."""


def model_file(directory: Path, writer_rank: int) -> Path:
    return directory / f"model-rank{writer_rank}.ckpt"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"state-rank{rank}.ckpt"


def committed_step(path: Path) -> int:
    """The newest step ``path`` can restore (an intact commit record, or a record of its
    differential log after it); -1 when none (or no file). Slot checksums are not checked."""
    peer = PeerFile(path)
    try:
        return peer.committed_step()
    finally:
        peer.close()


class RemoteWriter:
    """Another machine's model-file writer, followed through the job's store: its files are on that
    machine's disk, so its newest committed step travels as a key of the store instead.

    Args:
        store: the job's store (the default process group's).
        rank: the writer's rank.
    """

    def __init__(self, store: Any, rank: int):
        self.store, self.key = store, f"convoy/checkpoint/model-rank{rank}"

    def committed_step(self) -> int:
        if not self.store.check([self.key]):
            return -1
        return int(self.store.get(self.key))

    @staticmethod
    def publish(store: Any, rank: int, step: int) -> None:
        """Tell the other machines' writers that ``rank``'s model file holds ``step``."""
        store.set(f"convoy/checkpoint/model-rank{rank}", str(step))


class PeerFile:
    """Another rank's checkpoint file, polled for its newest committed step.

    The file stays open between polls (opening one reads the mount table and
    parses its layout), and is opened afresh when it was replaced (a rank
    file is created anew when its layout changes).
    """

    def __init__(self, path: Path):
        self.path = path
        self._store: Store | None = None
        self._inode = -1

    def committed_step(self) -> int:
        try:
            inode = os.stat(self.path).st_ino
            if inode != self._inode:
                self.close()
                self._store, self._inode = Store.open(self.path), inode
        except (OSError, FormatError):
            self.close()
            return -1
        newest = -1
        for area in range(AREAS):
            try:
                record = self._store.record(area)
            except FormatError:
                continue
            chain = read_chain(log_path(self.path, area), record.generation, record.step)
            newest = max(newest, chain[-1].step if chain else record.step)
        return newest

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store, self._inode = None, -1


class CheckpointListener(Listener):
    """Checkpoints every ``every``-th step (and the last) into ``directory``.

    Args:
        directory: where the files live (created by the caller).
        model: the model the engine trains.
        engine: the engine (for its layers, optimizers and sync strategy).
        every: checkpoint after steps ``every - 1, 2 * every - 1, ...`` (counting from 0),
            or ``"auto"``: the most frequent interval whose measured cost stays within ``budget``.
        last_step: also checkpoint after this step (the end of training).
        steps_per_epoch: to turn a step count into (epoch, position in the epoch).
        rank, writer_rank, local_ranks: this rank, its node's writer and the node's ranks.
        model_store: the writer's open, writable model file (``None`` on other ranks).
        model_generation, rank_generation, rank_store: where the last commits were
            (0 and ``None`` for a fresh start).
        peer_timeout_s: how long to wait for another rank's file before failing.
        full_names: the whole model's names of ``model``'s ``state_dict`` keys, when
            ``model`` is one part of it (hybrid parallelism); kept in every commit record.
        budget: ``every="auto"``, ``full_every="auto"``: the share of a step's time
            checkpoints may cost.
        full_every: differential checkpoints with a full snapshot every this many
            checkpoints (0: every checkpoint is full), or ``"auto"``: measure the first
            full snapshot and the steps after it, then the fewest checkpoints between
            full snapshots that keep the cost within ``budget`` (:func:`full_interval`).
            Only for updates that are exactly the optimizer's step on the averaged gradient.
        copy_on_write: write layers from the live tensors, the next update waiting for
            the persister (True), or from copies taken on the auxiliary thread (False:
            for strategies that change parameters outside the optimizer).
        replay: write the rank files only with the full snapshots (differential
            checkpoints whose rank state a resume rebuilds by replaying the logged
            steps: :mod:`convoy.checkpoint.replay`).
        quiet_until: the steps before this one are a resume's replay of steps the
            files already hold: nothing is written for them.

    Example::

        >>> listener = CheckpointListener(Path("ckpt"), model, engine, every=1, last_step=99,
        ...                               steps_per_epoch=50, rank=0, writer_rank=0, local_ranks=[0],
        ...                               model_store=Store.create(Path("ckpt/model-rank0.ckpt"), layout))
        >>> engine.listeners.append(listener)
    """

    def __init__(self, directory: Path, model: nn.Module, engine: Any, *, every: int | str, last_step: int,
                 steps_per_epoch: int, rank: int, writer_rank: int, local_ranks: list[int],
                 model_store: Store | None, model_generation: int = 0, rank_generation: int = 0,
                 rank_store: Store | None = None, peer_timeout_s: float = 300.0,
                 full_names: dict[str, str] | None = None, budget: float = DEFAULT_BUDGET,
                 full_every: int | str = 0, copy_on_write: bool = True, other_writers: list[int] = (),
                 replay: bool = False, quiet_until: int = 0, remote_writers: list[int] = (),
                 peer_store: Any = None, job: dict[str, int] | None = None):
        if every != "auto" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an integer >= 1 or 'auto', got {every!r}")
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if full_every != "auto" and (not isinstance(full_every, int) or full_every < 0):
            raise ValueError(f"full_every must be an integer >= 0 or 'auto', got {full_every!r}")
        if (rank == writer_rank) != (model_store is not None):
            raise ValueError("exactly the writer rank needs a model store")
        self.directory = Path(directory)
        self.model, self.engine = model, engine
        self.last_step, self.steps_per_epoch = last_step, steps_per_epoch
        self.rank, self.writer_rank, self.local_ranks = rank, writer_rank, local_ranks
        self.other_writers = list(other_writers)
        # Writers on other machines (torchrun on several hosts): kept within one checkpoint of this
        # one through the job's store, as those on this machine are through their files.
        self._remote = [RemoteWriter(peer_store, w) for w in remote_writers] if peer_store is not None else []
        self._peer_store = peer_store
        self.model_store, self.rank_store = model_store, rank_store
        self._model_gen, self._rank_gen = model_generation, rank_generation
        self._last_rank_step = max(rank_store.committed_steps(), default=-1) if rank_store else -1
        self._last_model_step = max(model_store.committed_steps(), default=-1) if model_store else -1
        # What the other machines' writers wait for is the step this file can restore, its log
        # included, as a local peer reads it (PeerFile): resumed inside a log, the snapshot's step
        # alone would hold every writer of a job that writes rank files each step (PowerSGD)
        # waiting for the others' model files at its first checkpoint, until --timeout.
        self._publish(committed_step(model_store.path) if model_store is not None else -1)
        self._timeout = peer_timeout_s
        self._full_names = full_names
        # What the records say of the job (its world size, global batch): a resume on another world reads it.
        self._job = dict(job or {})
        self._auto_full = _AutoFullInterval(budget) if full_every == "auto" else None
        self.full_every = FULL_EVERY_BOUNDS[0] if full_every == "auto" else full_every
        self.copy_on_write = copy_on_write
        self.replay = replay and self.full_every > 0
        self._replay_from, self._quiet_until = engine.step, quiet_until
        layout: Layout | None = model_store.layout if model_store is not None else None
        self._slot_of = {s.name: i for i, s in enumerate(layout.slots)} if layout else {}
        self._held = [False] * len(self._slot_of)          # slot being read by the persister
        self._grads: dict[int, tuple[int, difflog.BucketUpdate]] = {}   # slot -> (step, its bucket's update)
        self._hooked = False
        self._hook_handles: list[Any] = []
        self._step = engine.step                            # the step the auxiliary thread is in
        self._full_due, self._since_full = True, 0          # the writer's next checkpoint kind
        self._fulls = 0                                     # full snapshots taken in this run
        self._based = False                                 # a full snapshot was taken in this run
        self._log: DiffLog | None = None                    # the differential log being appended to
        self._cond = threading.Condition()
        self._ends_in_flight = 0
        self._buffers: dict[str, torch.Tensor] = {}
        # Residuals placed straight into images of the rank file's slot (the persister's thread
        # builds it once the layout is known): only where the checkpoint keeps references to them.
        self._memory = getattr(engine.sync, "memory", None) if copy_on_write else None
        self._arena: RankArena | None = None
        self._arena_store: Store | None = None   # the rank store the arena mirrors
        self._queue: queue.Queue = queue.Queue()
        self._peers: dict[Path, PeerFile] = {}
        self._error: BaseException | None = None
        # stall_s, blocked_s: wall time held on the training path; path_cpu_s: CPU time of the
        # training threads in this listener (less sensitive to other load); persist_*: the persister's.
        # Of persist_cpu_s: state_cpu_s this rank's own file, log_cpu_s the differential records.
        # full_cpu_s, update_cpu_s: the CPU of both threads spent on full snapshots and on the
        # differential steps' updates (logged_steps of them), for full_every="auto".
        self.stats = {"stall_s": 0.0, "blocked_s": 0.0, "path_cpu_s": 0.0, "persist_s": 0.0,
                      "persist_cpu_s": 0.0, "state_cpu_s": 0.0, "log_cpu_s": 0.0, "bytes_written": 0,
                      "commits": 0, "full": 0, "differential": 0, "full_cpu_s": 0.0, "update_cpu_s": 0.0,
                      "logged_steps": 0}
        self._auto = _AutoFrequency(max(engine.step, quiet_until), budget) if every == "auto" else None
        self.every = 1 if every == "auto" else every
        self._every_from = 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank builds a listener: collective calls.
            if self._auto is not None:
                self._auto.group = dist.new_group()
            if self._auto_full is not None:
                self._auto_full.group = dist.new_group()
        self._thread = threading.Thread(target=self._persist_main, name="convoy-persister", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        if step == self.last_step:
            return True
        if self._auto is not None and not self._auto.decided:
            return self._auto.probing_with_checkpoints(step)
        return (step + 1 - self._every_from) % self.every == 0

    def writes_rank_state(self) -> bool:
        """Whether this rank's file is written at its next checkpoint: at every one, or (replay)
        only with the full snapshots."""
        return not self.replay or self._full_due

    # ------------------------------------------------ engine's auxiliary thread
    def logs_update(self, step: int) -> bool:
        """Whether the writer appends ``step``'s update to the log: every step after a full
        snapshot (a later checkpoint replays them all), except the steps that take a new one."""
        return bool(self.model_store is not None and self.full_every and self._based
                    and not (self._full_due and self.due(step)))

    def on_layer_updated(self, layer: Any, step: int) -> None:
        if step < self._quiet_until:
            return   # a resume replaying steps the files already hold
        if not self._hooked:
            self._hook_optimizers()
        due, logged = self.due(step), self.logs_update(step)
        # A logged step's updates were kept by the optimizer hooks and go to the persister with
        # the step's end, in one item, not one per layer.
        state = due and self.writes_rank_state()
        if not state and (logged or not due):
            return
        start, cpu = time.perf_counter(), time.thread_time()
        self._raise_if_failed()
        if state:
            for name, buf in module_buffers(layer.name, layer.module):
                self._buffers[name] = buf.detach().clone()
        if self.model_store is not None and not logged:
            self._hand_over(layer, step)
        self.stats["stall_s"] += time.perf_counter() - start
        used = time.thread_time() - cpu
        self.stats["path_cpu_s"] += used
        self.stats["update_cpu_s" if logged else "full_cpu_s"] += used

    def _hand_over(self, layer: Any, step: int) -> None:
        """Queue the writer's part of ``layer`` at ``step``: its tensors."""
        index = self._slot_of[layer.name]
        tensors, meta = layer_sources(layer.module, layer.params, self.engine.optimizers[layer.index],
                                      self.model_store.layout.slots[index])
        if not self.copy_on_write or self.full_every:
            # Differential: a full snapshot is rare and large; held until the low-priority persister
            # had read it, resnet18's next updates waited ~350 ms a snapshot, a copy takes ~20 ms.
            tensors = [t.clone() for t in tensors]
        else:
            with self._cond:
                self._held[index] = True
        self._queue.put(("slot", step, index, tensors, meta))

    def _hook_optimizers(self) -> None:
        """Before a bucket's update: wait until the persister has read its layers' last
        checkpoint (copy-on-write), and keep its averaged gradient when the step is differential."""
        self._hooked = True
        if self.model_store is None:
            return
        groups: dict[int, tuple[torch.optim.Optimizer, list[Any]]] = {}
        for layer in self.engine.layers:
            optimizer = self.engine.optimizers[layer.index].optimizer
            groups.setdefault(id(optimizer), (optimizer, []))[1].append(layer)
        buckets = {id(self.engine.optimizers[b.layers[0].index].optimizer): b
                   for b in getattr(self.engine, "buckets", [])}
        self._hook_handles = [optimizer.register_step_pre_hook(self._make_pre_hook(layers, buckets.get(key)))
                              for key, (optimizer, layers) in groups.items()]

    def _make_pre_hook(self, layers: list[Any], bucket: Any) -> Any:
        indices = [self._slot_of[layer.name] for layer in layers]
        order = bucket.layers if bucket is not None else layers   # the flat gradient's layer order
        names = [layer.name for layer in order]

        def flat_grad() -> tuple[torch.Tensor, Any]:
            """The flat averaged gradient, and where it may be non-zero (None: anywhere)."""
            if bucket is not None:   # the bucket's buffer: every p.grad is a view into it
                return bucket.flat_grad(), bucket.support
            return torch.cat([p.grad.reshape(-1) for layer in order for p in layer.params]), None

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if any(self._held[index] for index in indices):
                self.stats["blocked_s"] += self._wait(lambda: not any(self._held[i] for i in indices))
            step = self._step
            if self.logs_update(step):
                cpu = time.thread_time()
                hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and _jsonable(v)}
                # Only the non-zero runs, copied now: the engine zeroes the gradient right after the
                # update. Where the exchange said which blocks it carried, only those are read.
                update = difflog.BucketUpdate(names, hyper, difflog.chunks_of(*flat_grad()))
                for index in indices:
                    self._grads[index] = (step, update)
                used = time.thread_time() - cpu
                self.stats["path_cpu_s"] += used
                self.stats["update_cpu_s"] += used
        return hook

    def on_step_end(self, step: int, stats: Any) -> None:
        cpu = time.thread_time()
        try:
            self._step_end(step)
        finally:
            self.stats["path_cpu_s"] += time.thread_time() - cpu

    def _step_end(self, step: int) -> None:
        self._step = step + 1
        if step < self._quiet_until:
            if step == self._quiet_until - 1:
                self._replay_ended()
            return
        if self._auto is not None and not self._auto.decided:
            self._auto.observe(step, self.stats)
            if self._auto.decided_at(step):
                self._adopt(self._auto.decide(self.stats), step)
        arena = self._arena
        if self._auto_full is not None and self._fulls and not self._auto_full.decided:
            self._auto_full.observe()
        updates = self._updates_of(step) if self.logs_update(step) else {}
        self.stats["logged_steps"] += bool(updates)
        if not self.due(step):
            if arena is not None:
                arena.step_ended(step)
            if updates:   # the writer's log record of a step between checkpoints
                self._queue_end(step, False, None, None, False, None, updates)
            return
        start = time.perf_counter()
        with_state, full = self.writes_rank_state(), self._full_due
        if self.full_every:   # every rank follows the schedule: replay writes rank files with the full ones
            self._fulls += full
            self._since_full = 0 if full else self._since_full + 1
            if self._auto_full is not None and not self._auto_full.decided \
                    and self._since_full + 1 >= self.full_every:
                self._adopt_full_every(self._auto_full.decide(self._measured(), self.every))
            self._full_due = self._since_full + 1 >= self.full_every
            self._based = True
        state = image = None
        if with_state:
            state = rank_state(self.model, self.engine.sync, self._buffers, self.engine.loss_scaler)
            self._buffers = {}
            # The step's image (if its tensors went to one) stays unused until the persister has read it.
            if arena is not None:
                held = arena.hold(step)
                image = None if held is None else (arena, held, arena.holds(held, state))
        if arena is not None:
            arena.step_ended(step)
        if self.model_store is None and state is None:
            return   # a differential checkpoint with replay: the writer's log record is all of it
        group = self.engine.optimizers[0].param_groups[0]
        extra = {"forward_order": [layer.name for layer in self.engine.layers],
                 "hyper": {k: v for k, v in group.items() if k != "params" and _jsonable(v)}, **self._job}
        if self._full_names is not None:
            extra["full_names"] = self._full_names
        self._queue_end(step, True, state, extra, full, image, updates)
        self.stats["stall_s"] += time.perf_counter() - start

    def _updates_of(self, step: int) -> dict[str, difflog.BucketUpdate | None]:
        """Every layer's update at ``step``, as the optimizer hooks kept it (None: the step skipped it)."""
        updates = {}
        for index, slot in enumerate(self.model_store.layout.slots):
            captured = self._grads.get(index)
            updates[slot.name] = captured[1] if captured is not None and captured[0] == step else None
        return updates

    def _queue_end(self, step: int, checkpoint: bool, state: dict | None, extra: dict | None, full: bool,
                   image: tuple[RankArena, int, bool] | None, updates: dict) -> None:
        # At most two steps' rank state in flight: bounded memory on every rank.
        self.stats["blocked_s"] += self._wait(lambda: self._ends_in_flight < 2)
        with self._cond:
            self._ends_in_flight += 1
        self._queue.put(("end", step, checkpoint, state, extra, full, image, updates))

    def _replay_ended(self) -> None:
        """The resume's replay is over: the exchanges go over the network again."""
        self.engine.sync.replay = None
        if self.rank == 0:
            print(f"convoy: checkpoint: resumed from the full snapshot at step {self._replay_from}, replayed "
                  f"{self._quiet_until - self._replay_from} steps to step {self._quiet_until}",
                  file=sys.stderr, flush=True)
    def _measured(self) -> dict[str, float]:
        """The listener's counters once the persister has caught up (it holds the last full snapshot's cost)."""
        self._wait(lambda: self._ends_in_flight == 0)
        return dict(self.stats, fulls=self._fulls)

    def _adopt_full_every(self, full_every: int) -> None:
        self.full_every = full_every
        if self.rank == 0:
            print(f"convoy: checkpoint: a full snapshot every {full_every} checkpoints, the longest interval any "
                  f"rank chose ({self._auto_full.describe()})", file=sys.stderr, flush=True)

    def _adopt(self, every: int, step: int) -> None:
        self.every, self._every_from = every, step + 1
        if self.rank == 0:
            print(f"convoy: checkpoint: every {every} step{'s' if every > 1 else ''}, the longest interval "
                  f"any rank chose ({self._auto.describe()})", file=sys.stderr, flush=True)

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
        lower_priority(PERSISTER_THREAD_NICE)
        checksums: dict[int, int] = {}
        metas: dict[str, Any] = {}
        try:
            while (item := self._queue.get()) is not None:
                start, cpu = time.perf_counter(), time.thread_time()
                if item[0] == "slot":
                    self._persist_slot(*item[1:], checksums, metas)
                else:
                    self._persist_end(*item[1:], checksums, metas)
                    checksums, metas = {}, {}
                self.stats["persist_s"] += time.perf_counter() - start
                used = time.thread_time() - cpu
                self.stats["persist_cpu_s"] += used
                full = item[0] == "slot" or (item[0] == "end" and item[5])
                self.stats["full_cpu_s" if full else "update_cpu_s"] += used
        except BaseException as exc:  # the auxiliary thread re-raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _persist_slot(self, step: int, index: int, tensors: list[torch.Tensor], meta: dict, checksums: dict,
                      metas: dict) -> None:
        store = self.model_store
        generation = self._model_gen + 1
        area = generation % AREAS
        if not checksums:   # first layer of this checkpoint: the area is no longer a valid one
            for writer in self._other_model_files():
                # The area holds this file's older step: another model file must hold the newer one
                # before it goes, or a crash now would leave no step that every file holds.
                self._await_peer(writer, self._last_model_step)
            store.invalidate(area)
            if self.full_every:   # this area's log extended the snapshot being overwritten
                DiffLog.start(log_path(store.path, area), generation, step + 1).close()
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
            checksums[index] = store.write_tensors(area, index, tensors, generation, read=release)
        finally:
            release()
        if meta:
            metas[store.layout.slots[index].name] = meta
        self.stats["bytes_written"] += store.layout.slots[index].nbytes

    def _persist_end(self, step: int, checkpoint: bool, state: dict | None, extra: dict | None, full: bool,
                     image: tuple[RankArena, int, bool] | None, updates: dict, checksums: dict,
                     metas: dict) -> None:
        done = step + 1
        if not checkpoint:   # a step between checkpoints: only the writer's log record
            self._commit_update(done, updates, checkpoint=False)
        else:
            epoch, position = divmod(done, self.steps_per_epoch)
            if state is not None:
                self._persist_own_file(done, epoch, position, state, image)
            if self.model_store is not None:
                if state is not None:   # with replay, rank files are written with the full snapshots only
                    for peer in self.local_ranks:
                        if peer != self.rank:
                            self._await_peer(rank_file(self.directory, peer), done)
                if full:
                    self._commit_full(done, epoch, position, extra, checksums, metas)
                else:
                    self._commit_update(done, updates)
        with self._cond:
            self._ends_in_flight -= 1
            self._cond.notify_all()

    def _persist_own_file(self, done: int, epoch: int, position: int, state: dict,
                          image: tuple[RankArena, int, bool] | None) -> None:
        if self.rank != self.writer_rank:
            # Never let this file get two checkpoints ahead of the model file.
            self._await_peer(model_file(self.directory, self.writer_rank), self._last_rank_step)
        for writer in self._other_model_files():
            # Nor a model file two checkpoints ahead of another: each keeps two, and a
            # resume needs a step every file holds.
            self._await_peer(writer, self._last_rank_step)
        try:
            self._persist_rank_state(done, epoch, position, state, image)
        finally:
            if image is not None:
                image[0].end_write(image[1])

    def _commit_full(self, done: int, epoch: int, position: int, extra: dict, checksums: dict,
                     metas: dict) -> None:
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
        if self.full_every:
            if self._log is not None:
                self._log.close()
            self._log = DiffLog.reopen(log_path(self.model_store.path, area), generation, done, done)
        self.stats["commits"] += 1
        self.stats["full"] += 1

    def _commit_update(self, done: int, updates: dict, checkpoint: bool = True) -> None:
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

    def _persist_rank_state(self, done: int, epoch: int, position: int, state: dict,
                            image: tuple[RankArena, int, bool] | None = None) -> None:
        """Write this rank's file; ``image``: the arena, the image the step's residuals went to,
        and whether they all did (then the image is written as it is)."""
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
        if image is not None and image[2] and image[0] is self._arena:
            arena, index, _ = image
            checksum = self.rank_store.write_image(area, 0, arena.fill(index, state), generation)
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
        """Have the memory put its residuals into images of the rank file's slot, where the
        file takes them as they are (page sums, O_DIRECT); else keep staging them."""
        self._arena, self._arena_store = None, self.rank_store
        if self._memory is not None and self.rank_store.can_write_images() and any(
                spec.key.startswith("sync.residual.") for spec in self.rank_store.layout.slots[0].tensors):
            arena = RankArena(self.rank_store.layout.slots[0])
            self._memory.place = lambda key, like: arena.place("sync." + key, like, self._step)
            self._arena = arena
        elif self._memory is not None:
            self._memory.place = None

    def _other_model_files(self) -> list[Path | RemoteWriter]:
        """The other writers' model files: paths on this machine, store keys for other machines'."""
        return [model_file(self.directory, writer) for writer in self.other_writers] + self._remote

    def _publish(self, step: int) -> None:
        if self._peer_store is not None and self.model_store is not None:
            RemoteWriter.publish(self._peer_store, self.writer_rank, step)

    def _await_peer(self, path: Path | RemoteWriter, step: int) -> None:
        deadline = time.monotonic() + self._timeout
        pause = _POLL_S[0]
        peer = path if isinstance(path, RemoteWriter) else self._peers.setdefault(path, PeerFile(path))
        while peer.committed_step() < step:
            if time.monotonic() > deadline:
                where = path if isinstance(path, Path) else f"the model file of {path.key.rsplit('-', 1)[1]}"
                raise CheckpointError(f"{where} did not reach step {step} within {self._timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])

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
        self._wait(lambda: self._ends_in_flight == 0 and not any(self._held))

    def close(self) -> None:
        """Persist what is queued, stop the persister and close the files."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._memory is not None:
            self._memory.place = None
        for handle in self._hook_handles:
            handle.remove()
        for store in (self.model_store, self.rank_store):
            if store is not None:
                store.close()
        for peer in self._peers.values():
            peer.close()
        if self._log is not None:
            self._log.close()
        self._raise_if_failed()


class _AutoFrequency:
    """CheckFreq's policy: measure, then the shortest interval whose cost fits the budget.

    Steps ``start .. start+W-1`` run without checkpoints, the next P with a
    checkpoint each; the first of each phase is not timed (warm-up). A
    checkpoint's cost is the slower step (the persister's interference
    included), at least the stall on the training path; the interval is also
    at least the persist time over the step time, so the writes keep up.
    """

    def __init__(self, start: int, budget: float):
        self.start, self.budget = start, budget
        self.group: Any = None
        self.decided = False
        self._ends: list[tuple[int, float]] = []
        self._stats0: dict[str, float] = {}
        self.summary: dict[str, float] = {}

    def probing_with_checkpoints(self, step: int) -> bool:
        off, on = AUTO_PROBE_STEPS
        return self.start + off <= step < self.start + off + on

    def decided_at(self, step: int) -> bool:
        return step == self.start + sum(AUTO_PROBE_STEPS) - 1

    def observe(self, step: int, stats: dict) -> None:
        self._ends.append((step, time.perf_counter()))
        if step == self.start + AUTO_PROBE_STEPS[0] - 1:
            self._stats0 = dict(stats)

    def decide(self, stats: dict) -> int:
        off, on = AUTO_PROBE_STEPS
        gaps = {s: t - t0 for (s0, t0), (s, t) in zip(self._ends, self._ends[1:])}
        plain = statistics.median(gaps[s] for s in range(self.start + 1, self.start + off) if s in gaps)
        checked = statistics.median(gaps[s] for s in range(self.start + off + 1, self.start + off + on)
                                    if s in gaps)
        stall = (stats["stall_s"] - self._stats0.get("stall_s", 0.0)) / on
        persist = (stats["persist_s"] - self._stats0.get("persist_s", 0.0)) / on
        cost = max(checked - plain, stall)
        every = max(1, math.ceil(cost / (self.budget * plain)), math.ceil(persist / plain))
        every = _largest_over(self.group, every)
        self.summary = {"step_s": plain, "cost_s": cost, "stall_s": stall, "persist_s": persist, "every": every}
        self.decided = True
        return every

    def describe(self) -> str:
        s = self.summary
        return (f"rank 0 measured: step {1000 * s['step_s']:.0f} ms, a checkpoint costs {1000 * s['cost_s']:.0f} ms "
                f"on the training path, persists in {1000 * s['persist_s']:.0f} ms; budget {100 * self.budget:g}%")


def full_interval(full_cost_s: float, update_cost_s: float, step_s: float, every: int, budget: float) -> int:
    """Checkpoints between full snapshots: the fewest whose cost per step fits ``budget``.

    A full snapshot costs ``full_cost_s`` and every step's logged update
    ``update_cost_s`` (CPU seconds of the listener's threads, a conservative
    measure where spare cores would absorb them); with a checkpoint every
    ``every`` steps of ``step_s``, ``K`` checkpoints apart the cost per step is
    ``update_cost_s + full_cost_s / (K * every)``. Bounded by
    ``FULL_EVERY_BOUNDS``: at least the interval used while measuring, at most
    the replay a resume may have to train again.

    Example::

        >>> full_interval(0.16, 0.006, 0.6, 1, 0.02)   # room: 12 - 6 ms a step
        27
    """
    low, high = FULL_EVERY_BOUNDS
    room = budget * step_s - update_cost_s
    if room <= 0:
        return high
    return min(high, max(low, math.ceil(full_cost_s / (room * every))))


class _AutoFullInterval:
    """``full_every="auto"``: from the first full snapshot's cost and the steps after it, the
    interval of :func:`full_interval`; every rank adopts the largest any rank chose."""

    def __init__(self, budget: float):
        self.budget = budget
        self.group: Any = None
        self.decided = False
        self._ends: list[float] = []
        self.summary: dict[str, float] = {}

    def observe(self) -> None:
        """A step ended (after the first full snapshot)."""
        self._ends.append(time.perf_counter())

    def decide(self, stats: dict, every: int) -> int:
        gaps = [b - a for a, b in zip(self._ends, self._ends[1:])]
        step_s = statistics.median(gaps) if gaps else 0.0
        full = stats["full_cpu_s"] / max(stats["fulls"], 1)
        update = stats["update_cpu_s"] / max(stats["logged_steps"], 1)
        chosen = _largest_over(self.group, full_interval(full, update, step_s, every, self.budget)
                               if step_s > 0 else FULL_EVERY_BOUNDS[1])
        self.summary = {"step_s": step_s, "full_s": full, "update_s": update}
        self.decided = True
        return chosen

    def describe(self) -> str:
        s = self.summary
        return (f"rank 0 measured: step {1000 * s['step_s']:.0f} ms, a full snapshot {1000 * s['full_s']:.0f} ms "
                f"and a step's update {1000 * s['update_s']:.1f} ms of CPU; budget {100 * self.budget:g}%")


def _largest_over(group: Any, value: int) -> int:
    """The largest ``value`` any rank of ``group`` chose (``value`` itself without a group)."""
    if group is None:
        return value
    chosen = torch.tensor([value])
    dist.all_reduce(chosen, op=dist.ReduceOp.MAX, group=group)
    return int(chosen)


def _jsonable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
