"""The engine listener that checkpoints layer by layer while training goes on.

On the engine's auxiliary thread, the moment a layer's update for a
checkpointed step is applied, ``on_layer_updated`` hands the layer to the
persister (:mod:`convoy.checkpoint.persister`), which writes it from the live
tensors while the other layers are still being exchanged and the next forward
runs. Nothing is copied on the training path: the layer's next update waits
(an optimizer step pre-hook) until the persister has read it, which with a
full step of slack it almost always has (copy-on-write in time rather than in
memory). The persister runs at the lowest CPU priority, so on a machine with
few cores its copies and checksums yield to the training threads.

Which steps are checkpointed, and which checkpoints are full snapshots and
which differential, is the :class:`~convoy.checkpoint.schedule.Schedule`'s
call. A differential step's update is the averaged gradient, kept by the same
pre-hook before the optimizer applies it; recovery replays it bit for bit.
Where a rank can rebuild its own state alone (``replay``), a resume trains the
logged steps again (:mod:`convoy.checkpoint.replay`).

The listener reads the engine only through :class:`CheckpointedEngine`.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from convoy.checkpoint import difflog
from convoy.checkpoint.persister import CheckpointFiles, LayerWrite, Persister, RankImage, StepEnd
from convoy.checkpoint.schedule import DEFAULT_BUDGET, Agree, Schedule
from convoy.checkpoint.snapshot import layer_sources, module_buffers, rank_state
from convoy.core import Listener, SyncStrategy
from convoy.utils.timeline import mark


class EngineLayer(Protocol):
    """One of the engine's layers (:class:`convoy.engine.layers.Layer`)."""

    index: int                     # position in forward order
    name: str
    module: nn.Module
    params: list[nn.Parameter]


class CheckpointedEngine(Protocol):
    """What checkpointing reads of the engine it checkpoints and resumes (:class:`convoy.engine.Engine` is one)."""

    step: int                      # the step the next backward belongs to
    layers: Sequence[EngineLayer]  # in forward order
    optimizers: Sequence[Any]      # per layer: ``.optimizer`` (its bucket's), ``.param_groups``
    buckets: Sequence[Any]         # ``.layers``, ``.flat_grad()``, ``.support``
    sync: SyncStrategy             # its state goes into the rank file; a resume may replay through it
    loss_scaler: Any
    gate: Any                      # a whole-step gradient gate (clipping, fp16 loss scaling), or None
    listeners: list[Listener]

    def load_optimizer_state(self, states: dict[str, Any]) -> None: ...
    def set_step(self, step: int) -> None: ...


class CheckpointListener(Listener):
    """Checkpoints every ``every``-th step (and the last) into ``files.directory``.

    Args:
        model: the model the engine trains.
        engine: the engine (for its layers, optimizers and sync strategy).
        files: this rank's files and the peers it keeps pace with.
        every, last_step, full_every, budget: when to checkpoint and what kind
            (:class:`~convoy.checkpoint.schedule.Schedule`); ``full_every`` only for
            updates that are exactly the optimizer's step on the averaged gradient.
        steps_per_epoch: to turn a step count into (epoch, position in the epoch).
        full_names: the whole model's names of ``model``'s ``state_dict`` keys, when
            ``model`` is one part of it (hybrid parallelism); kept in every commit record.
        copy_on_write: write layers from the live tensors, the next update waiting for
            the persister (True), or from copies taken on the auxiliary thread (False:
            for strategies that change parameters outside the optimizer).
        replay: write the rank files only with the full snapshots (differential
            checkpoints whose rank state a resume rebuilds by replaying the logged
            steps: :mod:`convoy.checkpoint.replay`).
        quiet_until: the steps before this one are a resume's replay of steps the
            files already hold: nothing is written for them.
        job: what the records say of the job (its world size, global batch): a resume on
            another world reads it.
        agree_groups: process groups of every rank (``ProcessGroups.agree_every``,
            ``agree_full``) over which an "auto" ``every`` and ``full_every`` are agreed;
            needed for "auto" on several ranks.

    Example::

        >>> files = CheckpointFiles(Path("ckpt"), rank=0, writer_rank=0, local_ranks=[0],
        ...                         model_store=Store.create(Path("ckpt/model-rank0.ckpt"), layout))
        >>> listener = CheckpointListener(model, engine, files, every=1, last_step=99, full_every=0,
        ...                               steps_per_epoch=50)
        >>> engine.listeners.append(listener)
    """

    def __init__(self, model: nn.Module, engine: CheckpointedEngine, files: CheckpointFiles, *,
                 every: int | str, last_step: int, full_every: int | str, steps_per_epoch: int,
                 budget: float = DEFAULT_BUDGET, full_names: dict[str, str] | None = None,
                 copy_on_write: bool = True, replay: bool = False, quiet_until: int = 0,
                 job: dict[str, Any] | None = None, agree_groups: tuple[Any, Any] = (None, None)):
        writer = files.model_store is not None
        agree: dict[str, Agree] = {}   # how the ranks agree on an "auto" interval (default: alone)
        if dist.is_initialized() and dist.get_world_size() > 1:
            for key, interval, group in zip(("agree_every", "agree_full"), (every, full_every), agree_groups):
                if interval == "auto":
                    if group is None:
                        raise ValueError(f"{key[6:]}=auto on {dist.get_world_size()} ranks needs its agree_groups "
                                         "entry (ProcessGroups.create(..., agree_every/agree_full=True))")
                    agree[key] = _largest_over(group)
        self.schedule = Schedule(every=every, last_step=last_step, full_every=full_every, writer=writer,
                                 budget=budget, replay=replay, start=max(engine.step, quiet_until), **agree)
        self.model, self.engine, self.rank = model, engine, files.rank
        self.copy_on_write = copy_on_write
        self._full_names = full_names
        self._job = dict(job or {})
        self._replay_from, self._quiet_until = engine.step, quiet_until
        layout = files.model_store.layout if writer else None
        self._slot_of = {s.name: i for i, s in enumerate(layout.slots)} if layout else {}
        self._grads: dict[int, tuple[int, difflog.BucketUpdate]] = {}   # slot -> (step, its bucket's update)
        self._hooked = False
        self._hook_handles: list[Any] = []
        self._step = engine.step                            # the step the auxiliary thread is in
        self._buffers: dict[str, torch.Tensor] = {}
        # stall_s, blocked_s: wall time held on the training path; path_cpu_s: CPU time of the
        # training threads in this listener (less sensitive to other load); persist_*: the persister's.
        # Of persist_cpu_s: state_cpu_s this rank's own file, log_cpu_s the differential records.
        # full_cpu_s, update_cpu_s: the CPU of both threads spent on full snapshots and on the
        # differential steps' updates (logged_steps of them), for full_every="auto".
        self.stats = {"stall_s": 0.0, "blocked_s": 0.0, "path_cpu_s": 0.0, "persist_s": 0.0,
                      "persist_cpu_s": 0.0, "state_cpu_s": 0.0, "log_cpu_s": 0.0, "bytes_written": 0,
                      "commits": 0, "full": 0, "differential": 0, "full_cpu_s": 0.0, "update_cpu_s": 0.0,
                      "logged_steps": 0}
        # Residuals placed straight into images of the rank file's slot (the persister's thread
        # builds it once the layout is known): only where the checkpoint keeps references to them.
        self.persister = Persister(files, steps_per_epoch=steps_per_epoch, differential=self.full_every > 0,
                                   job=self._job, stats=self.stats,
                                   place_state=engine.sync.place_state_in if copy_on_write else None,
                                   current_step=lambda: self._step)

    @property
    def every(self) -> int:
        """The interval in use (``"auto"``: 1 until decided)."""
        return self.schedule.every

    @property
    def full_every(self) -> int:
        """A full snapshot every this many checkpoints (0: all full), as in use."""
        return self.schedule.full_every

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    # ------------------------------------------------ engine's auxiliary thread
    def on_layer_updated(self, layer: EngineLayer, step: int) -> None:
        if step < self._quiet_until:
            return   # a resume replaying steps the files already hold
        if not self._hooked:
            self._hook_optimizers()
        due, logged = self.schedule.due(step), self.schedule.logs_update(step)
        # A logged step's updates were kept by the optimizer hooks and go to the persister with
        # the step's end, in one item, not one per layer.
        state = due and self.schedule.writes_rank_state()
        if not state and (logged or not due):
            return
        start, cpu = time.perf_counter(), time.thread_time()
        self.persister.raise_if_failed()
        if state:
            for name, buf in module_buffers(layer.name, layer.module):
                self._buffers[name] = buf.detach().clone()
        if self.persister.model_store is not None and not logged:
            self._hand_over(layer, step)
        self.stats["stall_s"] += time.perf_counter() - start
        used = time.thread_time() - cpu
        self.stats["path_cpu_s"] += used
        self.stats["update_cpu_s" if logged else "full_cpu_s"] += used

    def _hand_over(self, layer: EngineLayer, step: int) -> None:
        """Queue the writer's part of ``layer`` at ``step``: its tensors."""
        index = self._slot_of[layer.name]
        tensors, meta = layer_sources(layer.module, layer.params, self.engine.optimizers[layer.index],
                                      self.persister.model_store.layout.slots[index])
        live = self.copy_on_write and not self.full_every
        if not live:
            # Differential: a full snapshot is rare and large; held until the low-priority persister
            # had read it, resnet18's next updates waited ~350 ms a snapshot, a copy takes ~20 ms.
            tensors = [t.clone() for t in tensors]
        self.persister.hand_over(LayerWrite(step, index, tensors, meta), live=live)

    def _hook_optimizers(self) -> None:
        """Before a bucket's update: wait until the persister has read its layers' last
        checkpoint (copy-on-write), and keep its averaged gradient when the step is differential."""
        self._hooked = True
        if self.persister.model_store is None:
            return
        groups: dict[int, tuple[torch.optim.Optimizer, list[EngineLayer]]] = {}
        for layer in self.engine.layers:
            optimizer = self.engine.optimizers[layer.index].optimizer
            groups.setdefault(id(optimizer), (optimizer, []))[1].append(layer)
        buckets = {id(self.engine.optimizers[b.layers[0].index].optimizer): b for b in self.engine.buckets}
        self._hook_handles = [optimizer.register_step_pre_hook(self._make_pre_hook(layers, buckets.get(key)))
                              for key, (optimizer, layers) in groups.items()]

    def _make_pre_hook(self, layers: list[EngineLayer], bucket: Any) -> Callable[..., None]:
        indices = [self._slot_of[layer.name] for layer in layers]
        order = bucket.layers if bucket is not None else layers   # the flat gradient's layer order
        names = [layer.name for layer in order]

        def flat_grad() -> tuple[torch.Tensor, Any]:
            """The flat averaged gradient, and where it may be non-zero (None: anywhere)."""
            if bucket is not None:   # the bucket's buffer: every p.grad is a view into it
                return bucket.flat_grad(), bucket.support
            return torch.cat([p.grad.reshape(-1) for layer in order for p in layer.params]), None

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self.persister.held(indices):
                self.stats["blocked_s"] += self.persister.wait_released(indices)
            step = self._step
            if self.schedule.logs_update(step):
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
        self._announce(self.schedule.observe(step, time.perf_counter(), self.stats))
        arena = self.persister.arena
        updates = self._updates_of(step) if self.schedule.logs_update(step) else {}
        self.stats["logged_steps"] += bool(updates)
        if not self.schedule.due(step):
            if arena is not None:
                arena.step_ended(step)
            if updates:   # the writer's log record of a step between checkpoints
                self.stats["blocked_s"] += self.persister.end_step(StepEnd(step, updates))
            return
        start = time.perf_counter()
        with_state, full, decided = self.schedule.take(self._measured)
        self._announce(decided)
        state = image = None
        if with_state:
            state = rank_state(self.model, self.engine.sync, self._buffers, self.engine.loss_scaler)
            self._buffers = {}
            # The step's image (if its tensors went to one) stays unused until the persister has read it.
            if arena is not None:
                held = arena.hold(step)
                image = None if held is None else RankImage(arena, held, arena.holds(held, state))
        if arena is not None:
            arena.step_ended(step)
        if self.persister.model_store is None and state is None:
            return   # a differential checkpoint with replay: the writer's log record is all of it
        group = self.engine.optimizers[0].param_groups[0]
        extra = {"forward_order": [layer.name for layer in self.engine.layers],
                 "hyper": {k: v for k, v in group.items() if k != "params" and _jsonable(v)}, **self._job}
        if self._full_names is not None:
            extra["full_names"] = self._full_names
        self.stats["blocked_s"] += self.persister.end_step(
            StepEnd(step, updates, checkpoint=True, state=state, extra=extra, full=full, image=image))
        self.stats["stall_s"] += time.perf_counter() - start

    def _updates_of(self, step: int) -> dict[str, difflog.BucketUpdate | None]:
        """Every layer's update at ``step``, as the optimizer hooks kept it (None: the step skipped it)."""
        updates = {}
        for index, slot in enumerate(self.persister.model_store.layout.slots):
            captured = self._grads.get(index)
            updates[slot.name] = captured[1] if captured is not None and captured[0] == step else None
        return updates

    def _replay_ended(self) -> None:
        """The resume's replay is over: the exchanges go over the network again."""
        self.engine.sync.stop_replay()
        mark("replay ended")
        self._announce(f"resumed from the full snapshot at step {self._replay_from}, replayed "
                       f"{self._quiet_until - self._replay_from} steps to step {self._quiet_until}")

    def _measured(self) -> dict[str, float]:
        """The listener's counters once the persister has caught up (it holds the last full snapshot's cost)."""
        self.persister.drain()
        return dict(self.stats)

    def _announce(self, decided: str | None) -> None:
        if decided is not None and self.rank == 0:
            print(f"convoy: checkpoint: {decided}", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- control
    def commit_now(self, step: int) -> None:
        """Checkpoint ``step`` although it is not due: the job stops after it (a stop signal).

        Call from the training thread once the engine has applied ``step`` on
        every layer and runs no more steps (``engine.close()``); then :meth:`close`.
        """
        if self.schedule.due(step):
            return   # already staged by the engine's callbacks
        self.schedule.end_at(step)
        for layer in self.engine.layers:
            self.on_layer_updated(layer, step)
        self.on_step_end(step, None)

    def flush(self) -> None:
        """Block until everything queued so far is committed (or raise the persister's error)."""
        self.persister.flush()

    def close(self) -> None:
        """Persist what is queued, stop the persister and close the files."""
        try:
            self.persister.close()
        finally:
            for handle in self._hook_handles:
                handle.remove()


def _largest_over(group: Any) -> Callable[[int], int]:
    """The largest value any rank of ``group`` chose."""
    def agree(value: int) -> int:
        chosen = torch.tensor([value])
        dist.all_reduce(chosen, op=dist.ReduceOp.MAX, group=group)
        return int(chosen)
    return agree


def _jsonable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
