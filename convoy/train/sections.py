"""The sections of a training job's settings: one frozen dataclass per concern.

``config.optim.lr``, ``config.sync.servers``, ``config.checkpoint.dir``: each
section holds its settings as given (defaults, a config file, flags), with the
help text and limits in each field's metadata, and checks its own values in
``validate``, which returns the section as the job runs it (``--servers 2``
as the int 2, ``--checkpoint-every 4`` as 4) and changes nothing. The checks
that span sections, and the defaults that depend on other sections, are
:class:`convoy.train.config.TrainConfig`'s.

Example::

    >>> SyncConfig(strategy="ps", servers="2").validate().servers
    2
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from convoy.checkpoint.schedule import DEFAULT_BUDGET, DEFAULT_FULL_EVERY, DEFAULT_RANK_FILES, RANK_FILES
from convoy.cluster import (DEFAULT_CLUSTERS, DEFAULT_REELECT_EVERY, DEFAULT_SERVER_CHOICE, DEFAULT_WEIGHTS,
                            INDICATORS)
from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCKS_PER_LAYER, DEFAULT_DENSE_BELOW,
                             DEFAULT_ELEMENT_FRACTION, DEFAULT_METRIC, DEFAULT_POWERSGD_RANK, DEFAULT_SELECTION,
                             compressor_names, momentum_corrected_names, sparse_names)
from convoy.errors import UsageError
from convoy.ps.settings import DEFAULT_CHANNELS, DEFAULT_CREDIT_KB, DEFAULT_PRIORITY, DEFAULT_SLICE_KB
from convoy.runtime import DEFAULT_TIMEOUT_S
from convoy.sync.hierarchical import DEFAULT_EXCHANGE_EVERY
from convoy.train.checks import (MAX_BATCH_SIZE, MAX_COUNT, MAX_SAMPLE_ELEMENTS, MAX_SEED, MAX_TIMEOUT_S, at_least,
                                 check_fields, check_name, count_or_auto, fraction, max_local_processes, max_threads,
                                 one_of, positive, refuse_options_of_others, within)
from convoy.train.layouts import LAYOUTS
from convoy.train.strategies import STRATEGIES

OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
LR_SCHEDULE_NAMES = ("constant", "cosine")
AMP_NAMES = ("off", "bf16", "fp16")
LOGGER_NAMES = ("tensorboard", "csv")
DEVICE_NAMES = ("cpu", "cuda")
# Learning rates at which the built-in models train with the other defaults
# (vgg_fc's large fully connected layers diverge at 0.05 with momentum 0.9).
DEFAULT_LR = {"lenet": 0.03, "vgg_fc": 0.0125, "resnet18": 0.05}
OTHER_MODELS_LR = 0.03   # the default job's rate: a custom model trains like lenet unless told otherwise
# Steps of the density ramp a sparse compressor warms up with unless told otherwise.
SPARSE_WARMUP_STEPS = 100
DEFAULT_EPOCHS = 60  # the default job's length, chosen by bench/default_job.py (>= 97% for seeds 0-2)


def _opt(default: Any, help: str, *, flag: str | None = None, count: bool = False, path: bool = False,
         choices: Callable[[], tuple[str, ...]] | None = None) -> Any:
    """A setting of a section.

    Args:
        default: its value when neither the config file nor a flag gives one.
        help: its line in ``convoy train --help``; ``{choices}`` in it stands for ``choices()``.
        flag: its flat name (flag and top-level TOML key) when that is not the
            field's own name, e.g. ``checkpoint_dir`` for ``CheckpointConfig.dir``.
        count: a count, refused above MAX_COUNT.
        path: a path or import path, refused when empty.
        choices: the registry's names it takes, read when the help is shown (a plug-in registered
            by then is listed).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "count": count, "path": path,
                                            "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    """The network to train."""

    name: str = _opt("lenet", "lenet, vgg_fc, resnet18, or path/to/file.py:factory or package.module:factory "
                     "returning an nn.Module; the factory gets whichever of in_channels, num_classes, image_size "
                     "(H, W) it declares", flag="model", path=True)

    def validate(self) -> ModelConfig:
        from convoy.models import MODEL_NAMES

        check_fields(self)
        check_name("model", self.name, MODEL_NAMES)
        return self


@dataclass(frozen=True)
class DataConfig:
    """The dataset and how it is batched."""

    dataset: str = _opt("digits", "digits (embedded), mnist, cifar10, synthetic, or path/to/file.py:factory or "
                        "package.module:factory returning a DatasetSplits or a torch Dataset; the factory gets "
                        "data_dir if it declares it", path=True)
    dir: str | None = _opt(None, "folder holding the mnist IDX files or the cifar10 python batches",
                           flag="data_dir", path=True)
    synthetic_shape: str = _opt("3,32,32", "C,H,W of the synthetic dataset's images")
    # The default job (lenet on digits, 2 workers): chosen by bench/default_job.py, >= 97% for seeds 0-2.
    batch_size: int = _opt(16, "samples per worker per step (per micro-batch with --grad-accum); the global batch "
                               "is nproc x grad-accum x this")

    def validate(self) -> DataConfig:
        from convoy.data import DATASET_NAMES

        check_fields(self)
        within("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        check_name("dataset", self.dataset, DATASET_NAMES)
        self.synthetic_dims()
        return self

    def synthetic_dims(self) -> tuple[int, int, int]:
        try:
            dims = tuple(int(v) for v in self.synthetic_shape.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 3 or min(dims) < 1:
            raise UsageError(f"--synthetic-shape must be three positive integers C,H,W, got {self.synthetic_shape!r}")
        if math.prod(dims) > MAX_SAMPLE_ELEMENTS:
            raise UsageError(f"--synthetic-shape {self.synthetic_shape} has more than {MAX_SAMPLE_ELEMENTS} "
                             "elements per image")
        return dims  # type: ignore[return-value]


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning rate; mixed precision, accumulation and clipping (data parallelism only)."""

    name: str = _opt("sgd", "optimizer, applied layer by layer: " + ", ".join(OPTIMIZER_NAMES)
                     + ", or package.module:Class", flag="optimizer", path=True)
    lr: float | None = _opt(None, "learning rate (default per model: "
                            + ", ".join(f"{name} {lr}" for name, lr in DEFAULT_LR.items())
                            + f", others {OTHER_MODELS_LR})")
    momentum: float = _opt(0.9, "momentum (sgd, rmsprop)")
    weight_decay: float = _opt(5e-4, "L2 weight decay")
    lr_schedule: str = _opt("cosine", "learning-rate schedule: " + ", ".join(LR_SCHEDULE_NAMES))
    amp: str = _opt("off", "mixed precision: off, bf16 (works on CPU), or fp16 (with dynamic loss scaling)")
    grad_accum: int = _opt(1, "micro-batches per step: each worker runs --batch-size samples N times and "
                           "exchanges the summed gradient once (equal to an N-times larger batch)")
    clip_grad_norm: float | None = _opt(None, "scale the averaged gradient down to this global L2 norm; a step's "
                                        "updates then wait for all its exchanges")

    def validate(self) -> OptimConfig:
        """The optimizer's own values; the default rate, --amp, --grad-accum and --clip-grad-norm are
        checked by TrainConfig, as they depend on the model and the layout."""
        check_fields(self)
        if not 0.0 <= self.momentum < 1.0:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        one_of("lr_schedule", self.lr_schedule, LR_SCHEDULE_NAMES)
        check_name("optimizer", self.name, OPTIMIZER_NAMES)
        return self


@dataclass(frozen=True)
class RunConfig:
    """Length, evaluation, output and the worker processes."""

    steps: int | None = _opt(None, "train this many steps (exclusive with --epochs)", count=True)
    epochs: int | None = _opt(None, f"train this many epochs (default {DEFAULT_EPOCHS} when --steps is not given)",
                              count=True)
    eval_every: int = _opt(0, "evaluate on the test set every N steps (0: at the end only)", count=True)
    stop_at_accuracy: float | None = _opt(None, "stop once an evaluation reaches this test accuracy "
                                          "(0..1; needs --eval-every)")
    seed: int = _opt(0, "seed of the model's initialisation and the data order")
    out: str | None = _opt(None, "run folder for metrics and the final model (default runs/<time>)", path=True)
    logger: tuple[str, ...] = _opt((), "also log metrics to: tensorboard (events file), csv (metrics.csv); "
                                   "repeatable, a list in TOML; rank 0 only")
    threads: int = _opt(1, "torch threads per worker")
    timeout: float = _opt(DEFAULT_TIMEOUT_S, "seconds a collective waits for a peer before the job fails")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    device: str = _opt("cpu", "cpu (gloo) or cuda (NCCL; each process uses the GPU of its local rank)")

    def validate(self) -> RunConfig:
        """The values, with ``logger`` as a tuple."""
        import torch

        check_fields(self)
        within("threads", self.threads, 1, max_threads())
        within("seed", self.seed, 0, MAX_SEED)
        if self.timeout > MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be <= {MAX_TIMEOUT_S:g} seconds, got {self.timeout:g}")
        positive("timeout", self.timeout)
        at_least("eval_every", self.eval_every, 0)
        if self.stop_at_accuracy is not None:
            if not 0.0 < self.stop_at_accuracy <= 1.0:
                raise UsageError(f"--stop-at-accuracy must be in (0, 1], got {self.stop_at_accuracy}")
            if not self.eval_every:
                raise UsageError("--stop-at-accuracy needs --eval-every N to evaluate during training")
        if self.steps is not None and self.epochs is not None:
            raise UsageError("give --steps or --epochs, not both")
        if self.steps is not None:
            at_least("steps", self.steps, 1)
        if self.epochs is not None:
            at_least("epochs", self.epochs, 1)
        one_of("device", self.device, DEVICE_NAMES)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")
        for name in self.logger:
            one_of("logger", name, LOGGER_NAMES)
        return dataclasses.replace(self, logger=tuple(self.logger))   # a TOML list, or config.json's

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.steps is not None:
            return self.steps
        return (self.epochs or DEFAULT_EPOCHS) * steps_per_epoch


@dataclass(frozen=True)
class SyncConfig:
    """How workers exchange gradients (the ``--sync`` strategy and its options)."""

    strategy: str = _opt("allreduce", "gradient synchronisation strategy: {choices}", flag="sync",
                         choices=STRATEGIES.names)
    clusters: str = _opt(DEFAULT_CLUSTERS, "hierarchical: number of node clusters K, or auto (the K with the best "
                         "silhouette score)")
    exchange_every: int = _opt(DEFAULT_EXCHANGE_EVERY, "hierarchical: T, batches per exchange cycle; the clusters' "
                               "parameters are combined after every T-th batch", count=True)
    reelect_every: int = _opt(DEFAULT_REELECT_EVERY, "hierarchical: R, exchange cycles between elections of the "
                              "clusters' servers", count=True)
    server_choice: str = _opt(DEFAULT_SERVER_CHOICE, "hierarchical: how each cluster's temporary server is elected: "
                              "random (seeded order, rotating) or capable (highest weighted indicators)")
    indicator_weights: str | None = _opt(None, "hierarchical: indicator weights as name=value pairs (cpu_mhz, "
                                         "memory_gb, gpu_mhz, gpu_memory_gb, disk_mbps, uplink_mbps) or six "
                                         "numbers; default " + ",".join(f"{DEFAULT_WEIGHTS[n]:g}" for n in INDICATORS))
    node_profile: str | None = _opt(None, "hierarchical: TOML file of node indicators overriding the measured "
                                    "ones ([all], [hosts.NAME], [ranks.N] tables)", path=True)
    servers: str | int | None = _opt(None, "ps: colocated (every rank serves a shard of the parameters and trains; "
                                     "the default with --parallel data), or S, the ranks 0..S-1 that serve the "
                                     "parameters while the other ranks train (the default with --parallel hybrid "
                                     "is 1)")
    staleness: int = _opt(0, "ps (colocated servers): S, steps a worker may run ahead of the slowest: the forward "
                          "of step t runs on the parameters of step t - S (a fixed delay, reproducible); 0 is "
                          "synchronous and exact", count=True)
    shard_weights: str | tuple[float, ...] | None = _opt(None, "ps (colocated servers): each rank's share of the parameters, in "
                                     "proportion, one number > 0 per rank (e.g. 1,1,1,0.25: a rank on a slower "
                                     "link serves less, so its link carries less), or links: and each rank's "
                                     "link rate (links:1gbit,1gbit,250mbit: the shares that make the busiest "
                                     "link's step shortest); default: equal shares")
    channels: int | None = _opt(None, f"ps: connections (process groups) per server-worker pair (default "
                                f"{DEFAULT_CHANNELS}; fifo: 1)",
                                count=True)
    priority: str = _opt(DEFAULT_PRIORITY, "ps: transfer order: graph (the next forward's order, traced), timed (also "
                         "weighs measured run and transfer times), or fifo (arrival order, whole tensors)")
    slice_kb: float | None = _opt(None, f"ps: cut transfers into slices of this many KB (default "
                                  f"{DEFAULT_SLICE_KB:g}; fifo: whole tensors)")
    credit_kb: float | None = _opt(None, f"ps: KB a sender keeps in flight to each peer at most, until the "
                                   f"receiver acknowledges them (default {DEFAULT_CREDIT_KB:g}; fifo: no limit)")
    trace: bool = _opt(False, "ps: record a timeline of --trace-steps steps; writes trace.json (Chrome trace) "
                       "into the run folder")
    trace_steps: int = _opt(3, "ps: steps the --trace timeline covers (after the first)", count=True)

    def validate(self) -> SyncConfig:
        """The strategy's own options, with ``servers`` (an int or ``"colocated"``) and ``shard_weights``
        (the shares) parsed; the cluster count and the servers are checked against the world by TrainConfig."""
        from convoy.ps.settings import check, parse_servers, parse_shard_weights

        check_fields(self)
        refuse_options_of_others(self, "sync", STRATEGIES.spec(self.strategy), STRATEGIES.specs())
        servers = self.servers if self.servers is None else parse_servers(self.servers)
        if isinstance(servers, int) and servers > MAX_COUNT:
            raise UsageError(f"--servers must be <= {MAX_COUNT}, got {servers}")
        check(servers if isinstance(servers, int) else None, self.priority, self.channels, self.slice_kb,
              self.credit_kb, self.staleness)
        # The shares themselves from here on (links: resolved once).
        weights = self.shard_weights if self.shard_weights is None else parse_shard_weights(self.shard_weights)
        at_least("trace_steps", self.trace_steps, 1)
        return dataclasses.replace(self, servers=servers, shard_weights=weights)


@dataclass(frozen=True)
class CompressConfig:
    """Gradient compression and error feedback."""

    name: str = _opt("none", f"gradient compressor: {', '.join(compressor_names())}", flag="compress")
    blocks_per_layer: int | None = _opt(None, f"blocktopk: blocks kept per parameter (default "
                                        f"{DEFAULT_BLOCKS_PER_LAYER}; exclusive with --block-fraction)", count=True)
    block_fraction: float | None = _opt(None, "blocktopk: fraction of each parameter's blocks kept, "
                                        "in (0, 1], at least one")
    block_metric: str = _opt(DEFAULT_METRIC, "blocktopk: norm that scores a block: l1 or l2 (l2 chosen by "
                             "measurement: vgg_fc ended nearer dense, docs/compression.md)")
    block_selection: str = _opt(DEFAULT_SELECTION, "blocktopk: local (each rank its own blocks, all-gathered) or "
                                "global (scores summed, the same blocks on every rank, all-reduced)")
    element_fraction: float = _opt(DEFAULT_ELEMENT_FRACTION,
                                   "topk, randomk: fraction of each layer's elements sent, in (0, 1]")
    warmup_steps: int | None = _opt(None, "warm-up: blocktopk --block-fraction, topk and randomk send 25%% of "
                                    "each layer at step 0, decaying exponentially to their own share at step "
                                    "N; other compressors send the first N steps uncompressed (default: "
                                    f"{SPARSE_WARMUP_STEPS} for the former, 0 otherwise)", count=True)
    # Sparse compression that converges (DGC's fixes)
    block_size: int = _opt(DEFAULT_BLOCK_SIZE, "blocktopk: elements per block (exactly: the largest divisor of a parameter's "
                           "size not above N), so small and large layers are cut alike")
    dense_below: int = _opt(DEFAULT_DENSE_BELOW, "blocktopk: parameters of fewer than N elements (biases, small layers, a "
                            "classifier head) are sent whole every step; 0: every parameter is cut")
    # PowerSGD inside the engine
    powersgd_rank: int = _opt(DEFAULT_POWERSGD_RANK, "powersgd: R, columns of each layer's factors P and Q (an integer >= 1); a "
                              "layer whose matrix has a side of R or fewer, or that factors would not shrink "
                              "2x, is sent dense (4 chosen by measurement: rank 2 ended further below dense "
                              "on vgg_fc, docs/compression.md)", count=True)
    momentum_masking: bool = _opt(False, "with momentum correction and a sparse compressor: zero the velocity "
                                  "where a value that had waited is sent (DGC's momentum factor masking; off by "
                                  "default: it slowed vgg_fc's start, docs/compression.md)")
    momentum_correction: bool = _opt(True, f"{', '.join(momentum_corrected_names())} with sgd and --momentum > 0: "
                                     "accumulate the velocity on each worker and compress that (error feedback "
                                     "on the velocity), applying the average without the optimizer's momentum")
    clip_norm: float = _opt(5.0, "with momentum correction: clip each parameter's local gradient to this L2 "
                            "norm / sqrt(workers) before accumulating it")
    sparse_lr_scale: float = _opt(1.2, f"{', '.join(sparse_names())} without --lr: the model's default rate times "
                                  "this (a sparse update arrives late; 1.2 measured on vgg_fc, docs/compression.md)")

    def validate(self) -> CompressConfig:
        from convoy.compress import METRICS, SELECTIONS

        check_fields(self)
        one_of("compress", self.name, compressor_names())
        if self.blocks_per_layer is not None:
            at_least("blocks_per_layer", self.blocks_per_layer, 1)
        if self.block_fraction is not None:
            fraction("block_fraction", self.block_fraction)
            if self.blocks_per_layer is not None:
                raise UsageError("give --blocks-per-layer or --block-fraction, not both")
        one_of("block_metric", self.block_metric, METRICS)
        one_of("block_selection", self.block_selection, SELECTIONS)
        fraction("element_fraction", self.element_fraction)
        if self.warmup_steps is not None:
            at_least("warmup_steps", self.warmup_steps, 0)
        at_least("block_size", self.block_size, 1)
        at_least("dense_below", self.dense_below, 0)
        at_least("powersgd_rank", self.powersgd_rank, 1)
        positive("clip_norm", self.clip_norm)
        positive("sparse_lr_scale", self.sparse_lr_scale)
        return self

    def default_lr_scale(self) -> float:
        """What the model's default rate is multiplied by when ``--lr`` is not given: ``sparse_lr_scale``
        for a sparse compressor, else 1."""
        return self.sparse_lr_scale if self.name in sparse_names() else 1.0

    def warmup(self) -> int:
        """``--warmup-steps``, or its default: a density ramp for a compressor that sends a share."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ramps = self.name in ("topk", "randomk") or (self.name == "blocktopk" and self.block_fraction)
        return SPARSE_WARMUP_STEPS if ramps else 0


@dataclass(frozen=True)
class ParallelConfig:
    """Processes and how the model is laid out over them."""

    nproc: int = _opt(2, "local worker processes to spawn (ignored under torchrun)")
    layout: str = _opt("data", "parallel layout: {choices} (hybrid: conv layers data-parallel on "
                       "--conv-workers, the FC head on --fc-workers)", flag="parallel", choices=LAYOUTS.names)
    conv_workers: int | None = _opt(None, "hybrid: I, the ranks 0..I-1 that train the conv layers", count=True)
    fc_workers: int | None = _opt(None, "hybrid: J, the ranks I..I+J-1 that train the FC head (I divisible by J)",
                                  count=True)
    split_at: str | None = _opt(None, "hybrid: the child module where the FC head begins "
                                "(default: the model's classifier, or its first Flatten/Linear after the last conv)")
    sub_batches: int = _opt(1, "hybrid: send activations in K pieces so the link overlaps the FC "
                            "head's compute (at most --batch-size)", count=True)

    def validate(self) -> ParallelConfig:
        check_fields(self)
        within("nproc", self.nproc, 1, max_local_processes())
        refuse_options_of_others(self, "parallel", LAYOUTS.spec(self.layout), LAYOUTS.specs())
        at_least("sub_batches", self.sub_batches, 1)
        return self


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, resuming, and initial weights."""

    dir: str | None = _opt(None, "checkpoint layer by layer into this directory (a DAX/pmem "
                           "mount is used as such); resumes from it when it holds a checkpoint",
                           flag="checkpoint_dir", path=True)
    every: str | int = _opt("1", "checkpoint every N steps (and after the last one), or auto: measure "
                      "a checkpoint's cost and checkpoint as often as --checkpoint-budget allows (every step "
                      "loses no step to a crash but costs most where the compressor's state is dense, "
                      "e.g. powersgd)", flag="checkpoint_every")
    budget: float = _opt(DEFAULT_BUDGET, "--checkpoint-every auto, --checkpoint-full-every auto: the share of step "
                         "time checkpoints may cost, in (0, 0.5]", flag="checkpoint_budget")
    full_every: str | int = _opt(DEFAULT_FULL_EVERY, "with a compressor other than fp16 under --sync "
                                 "allreduce: a full snapshot every N checkpoints, the "
                                 "exchanged update in between (1: always full), or auto: measure the first full "
                                 "snapshot, then the fewest checkpoints between full ones (10 to 100) that keep "
                                 "within --checkpoint-budget; a resume may train up to that many steps again",
                                 flag="checkpoint_full_every")
    rank_files: str = _opt(DEFAULT_RANK_FILES, "with a compressor whose residuals a resume can rebuild by "
                           "replaying the steps since a full snapshot (topk, blocktopk, randomk): write every "
                           "rank's own file at every checkpoint (every: a resume on fewer or more workers goes on "
                           "from the newest step), or only with the full snapshots (full: less written each step; "
                           "a resume on another number of workers goes back to the last full snapshot)",
                           flag="checkpoint_rank_files")
    resume: bool | None = _opt(None, "resume from --checkpoint-dir (--resume: fail if it holds none; "
                               "--no-resume: start over, overwriting it); default: resume if it holds one")
    init_from: str | None = _opt(None, "start from the parameters of this state_dict file (.pt), e.g. "
                                 "from convoy checkpoint export", path=True)

    def validate(self) -> CheckpointConfig:
        """The values, with ``every`` and ``full_every`` as ints (or ``"auto"``); the directory itself is
        created and checked by :func:`convoy.train.config.build_config`, and by the workers."""
        check_fields(self)
        every = count_or_auto("checkpoint_every", self.every)
        if not 0.0 < self.budget <= 0.5:
            raise UsageError(f"--checkpoint-budget must be in (0, 0.5], got {self.budget:g}")
        full_every = count_or_auto("checkpoint_full_every", self.full_every)
        one_of("checkpoint_rank_files", self.rank_files, RANK_FILES)
        if self.resume is not None and self.dir is None:
            raise UsageError("--resume/--no-resume needs --checkpoint-dir")
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise UsageError(f"--init-from {self.init_from} does not exist")
        return dataclasses.replace(self, every=every, full_every=full_every)
