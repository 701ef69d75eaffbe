"""Every setting of a training job, with its default, help text and check.

The settings are grouped by concern, one small dataclass per section
(``config.optim.lr``, ``config.sync.servers``, ``config.checkpoint.dir``). The
same sections are the argument groups of ``convoy train --help``, the [tables]
of a ``--config`` TOML file and the objects of a run folder's config.json.
Each field's metadata is the one table the command line, the TOML keys and the
help are built from, so a flag and a config key never disagree: a setting's
flat name (``clip_grad_norm``, ``checkpoint_dir``) is its flag
(``--clip-grad-norm``, ``--checkpoint-dir``) and its top-level TOML key; inside
its section's table both the flat name and the field's own name
(``[checkpoint] dir``) are accepted.

Example::

    config = TrainConfig.from_flat(model="vgg_fc", sync="ps", nproc=3, steps=20).validate()
    config.sync.strategy, config.sync.servers   # ("ps", None): the flags as given
    config.optim.lr                             # 0.0125, vgg_fc's default rate

Each section checks its own values (``OptimConfig.validate``);
``TrainConfig.validate`` runs them all and then the checks that span sections
(``--sub-batches`` against ``--batch-size``, ``--servers`` against the world).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from convoy.compress import (DEFAULT_BLOCK_SIZE, DEFAULT_DENSE_BELOW, DEFAULT_METRIC, DEFAULT_POWERSGD_RANK,
                             MOMENTUM_CORRECTED_NAMES)
from convoy.errors import UsageError
from convoy.ps.settings import DEFAULT_CHANNELS, DEFAULT_CREDIT_KB, DEFAULT_SLICE_KB
from convoy.utils.suggest import did_you_mean
from convoy.utils.toml import read_toml

if TYPE_CHECKING:
    from convoy.parallel.shape import JobShape


OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
LR_SCHEDULE_NAMES = ("constant", "cosine")
AMP_NAMES = ("off", "bf16", "fp16")
LOGGER_NAMES = ("tensorboard", "csv")
DEVICE_NAMES = ("cpu", "cuda")
# What --model, --dataset and --optimizer accept besides their built-in names.
IMPORT_FORMS = ("file.py:factory", "package.module:factory")
# Learning rates at which the built-in models train with the other defaults
# (vgg_fc's large fully connected layers diverge at 0.05 with momentum 0.9).
DEFAULT_LR = {"lenet": 0.03, "vgg_fc": 0.0125, "resnet18": 0.05}
OTHER_MODELS_LR = 0.03   # the default job's rate: a custom model trains like lenet unless told otherwise
# Steps of the density ramp a sparse compressor warms up with unless told otherwise.
SPARSE_WARMUP_STEPS = 100


DEFAULT_EPOCHS = 60  # the default job's length, chosen by bench/default_job.py (>= 97% for seeds 0-2)

# Ceilings of the integer settings. A local run's processes share one machine:
# more than MAX_NPROC of them, or more torch threads than THREADS_PER_CORE per
# core, only thrash (and very large values exhaust the process limit).
MAX_NPROC = 256
THREADS_PER_CORE = 4
MAX_BATCH_SIZE = 1 << 20
MAX_SAMPLE_ELEMENTS = 1 << 24    # 64 MB of float32 per image
MAX_SEED = 2**63 - 1          # torch.manual_seed takes a signed 64-bit integer
MAX_COUNT = 10**9             # steps, epochs and the other counts
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _opt(default: Any, help: str, *, flag: str | None = None, count: bool = False, path: bool = False) -> Any:
    """A setting of a section.

    Args:
        default: its value when neither the config file nor a flag gives one.
        help: its line in ``convoy train --help``.
        flag: its flat name (flag and top-level TOML key) when that is not the
            field's own name, e.g. ``checkpoint_dir`` for ``CheckpointConfig.dir``.
        count: a count, refused above MAX_COUNT.
        path: a path or import path, refused when empty.
    """
    return field(default=default, metadata={"help": help, "flag": flag, "count": count, "path": path})


@dataclass
class ModelConfig:
    """The network to train."""

    name: str = _opt("lenet", "lenet, vgg_fc, resnet18, or path/to/file.py:factory or package.module:factory "
                     "returning an nn.Module; the factory gets whichever of in_channels, num_classes, image_size "
                     "(H, W) it declares", flag="model", path=True)

    def validate(self) -> None:
        from convoy.models import MODEL_NAMES

        _check_fields(self)
        _check_name("model", self.name, MODEL_NAMES)


@dataclass
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

    def validate(self) -> None:
        from convoy.data import DATASET_NAMES

        _check_fields(self)
        _within("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        _check_name("dataset", self.dataset, DATASET_NAMES)
        self.synthetic_dims()

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


@dataclass
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

    def validate(self) -> None:
        """The optimizer's own values; the default rate, --amp, --grad-accum and --clip-grad-norm are
        checked by TrainConfig, as they depend on the model and the layout."""
        _check_fields(self)
        if not 0.0 <= self.momentum < 1.0:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULE_NAMES)
        _check_name("optimizer", self.name, OPTIMIZER_NAMES)


@dataclass
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
    timeout: float = _opt(300.0, "seconds a collective waits for a peer before the job fails")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    device: str = _opt("cpu", "cpu (gloo) or cuda (NCCL; each process uses the GPU of its local rank)")

    def validate(self) -> None:
        import torch

        _check_fields(self)
        _within("threads", self.threads, 1, max_threads())
        _within("seed", self.seed, 0, MAX_SEED)
        if self.timeout > MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be <= {MAX_TIMEOUT_S:g} seconds, got {self.timeout:g}")
        _positive("timeout", self.timeout)
        _at_least("eval_every", self.eval_every, 0)
        if self.stop_at_accuracy is not None:
            if not 0.0 < self.stop_at_accuracy <= 1.0:
                raise UsageError(f"--stop-at-accuracy must be in (0, 1], got {self.stop_at_accuracy}")
            if not self.eval_every:
                raise UsageError("--stop-at-accuracy needs --eval-every N to evaluate during training")
        if self.steps is not None and self.epochs is not None:
            raise UsageError("give --steps or --epochs, not both")
        if self.steps is not None:
            _at_least("steps", self.steps, 1)
        if self.epochs is not None:
            _at_least("epochs", self.epochs, 1)
        _one_of("device", self.device, DEVICE_NAMES)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.steps is not None:
            return self.steps
        return (self.epochs or DEFAULT_EPOCHS) * steps_per_epoch


@dataclass
class SyncConfig:
    """How workers exchange gradients (allreduce, hierarchical, ps)."""

    strategy: str = _opt("allreduce", "gradient synchronisation strategy: allreduce, hierarchical or ps",
                         flag="sync")
    clusters: str = _opt("auto", "hierarchical: number of node clusters K, or auto (the K with the best "
                         "silhouette score)")
    exchange_every: int = _opt(4, "hierarchical: T, batches per exchange cycle; the clusters' parameters are "
                               "combined after every T-th batch", count=True)
    reelect_every: int = _opt(4, "hierarchical: R, exchange cycles between elections of the clusters' servers",
                              count=True)
    server_choice: str = _opt("random", "hierarchical: how each cluster's temporary server is elected: random "
                              "(seeded order, rotating) or capable (highest weighted indicators)")
    indicator_weights: str | None = _opt(None, "hierarchical: indicator weights as name=value pairs (cpu_mhz, "
                                         "memory_gb, gpu_mhz, gpu_memory_gb, disk_mbps, uplink_mbps) or six "
                                         "numbers; default 1,0.5,1,0.5,0.5,2")
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
    priority: str = _opt("graph", "ps: transfer order: graph (the next forward's order, traced), timed (also "
                         "weighs measured run and transfer times), or fifo (arrival order, whole tensors)")
    slice_kb: float | None = _opt(None, f"ps: cut transfers into slices of this many KB (default "
                                  f"{DEFAULT_SLICE_KB:g}; fifo: whole tensors)")
    credit_kb: float | None = _opt(None, f"ps: KB a sender keeps in flight to each peer at most, until the "
                                   f"receiver acknowledges them (default {DEFAULT_CREDIT_KB:g}; fifo: no limit)")
    trace: bool = _opt(False, "ps: record a timeline of --trace-steps steps; writes trace.json (Chrome trace) "
                       "into the run folder")
    trace_steps: int = _opt(3, "ps: steps the --trace timeline covers (after the first)", count=True)

    def validate(self) -> None:
        """The strategy's own options; the cluster count and the servers are checked against the world
        by TrainConfig."""
        from convoy.ps.settings import check, parse_servers, parse_shard_weights
        from convoy.sync import SYNC_NAMES

        _check_fields(self)
        _one_of("sync", self.strategy, SYNC_NAMES)
        if self.servers is not None:
            self.servers = parse_servers(self.servers)
            if isinstance(self.servers, int) and self.servers > MAX_COUNT:
                raise UsageError(f"--servers must be <= {MAX_COUNT}, got {self.servers}")
        check(self.servers if isinstance(self.servers, int) else None, self.priority, self.channels, self.slice_kb,
              self.credit_kb, self.staleness)
        if self.shard_weights is not None:   # the shares themselves from here on (links: resolved once)
            self.shard_weights = parse_shard_weights(self.shard_weights)
        _at_least("trace_steps", self.trace_steps, 1)
        if self.strategy != "ps":
            given = [f for f in ("servers", "channels", "slice_kb", "credit_kb", "shard_weights")
                     if getattr(self, f) is not None]
            if given or self.priority != "graph" or self.trace or self.staleness:
                raise UsageError("--servers, --staleness, --shard-weights, --channels, --priority, --slice-kb, "
                                 "--credit-kb and --trace need --sync ps")
        if self.strategy != "hierarchical":
            if self.node_profile is not None or self.indicator_weights is not None or self.clusters != "auto":
                raise UsageError("--clusters, --indicator-weights and --node-profile need --sync hierarchical")
        else:
            _at_least("exchange_every", self.exchange_every, 1)


@dataclass
class CompressConfig:
    """Gradient compression and error feedback."""

    name: str = _opt("none", "gradient compressor: none, fp16, blocktopk, topk, randomk, powersgd", flag="compress")
    blocks_per_layer: int | None = _opt(None, "blocktopk: blocks kept per parameter (default 1; "
                                        "exclusive with --block-fraction)", count=True)
    block_fraction: float | None = _opt(None, "blocktopk: fraction of each parameter's blocks kept, "
                                        "in (0, 1], at least one")
    block_metric: str = _opt(DEFAULT_METRIC, "blocktopk: norm that scores a block: l1 or l2 (l2 chosen by "
                             "measurement: vgg_fc ended nearer dense, docs/compression.md)")
    block_selection: str = _opt("local", "blocktopk: local (each rank its own blocks, all-gathered) or "
                                "global (scores summed, the same blocks on every rank, all-reduced)")
    element_fraction: float = _opt(0.01, "topk, randomk: fraction of each layer's elements sent, in (0, 1]")
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
    momentum_correction: bool = _opt(True, f"{', '.join(MOMENTUM_CORRECTED_NAMES)} with sgd and --momentum > 0: "
                                     "accumulate the velocity on each worker and compress that (error feedback "
                                     "on the velocity), applying the average without the optimizer's momentum")
    clip_norm: float = _opt(5.0, "with momentum correction: clip each layer's local gradient to this L2 "
                            "norm / sqrt(workers) before accumulating it")
    sparse_lr_scale: float = _opt(1.2, "blocktopk, topk, randomk without --lr: the model's default rate times "
                                  "this (a sparse update arrives late; 1.2 measured on vgg_fc, docs/compression.md)")

    def validate(self) -> None:
        from convoy.compress import COMPRESS_NAMES, METRICS, SELECTIONS

        _check_fields(self)
        _one_of("compress", self.name, COMPRESS_NAMES)
        if self.blocks_per_layer is not None:
            _at_least("blocks_per_layer", self.blocks_per_layer, 1)
        if self.block_fraction is not None:
            _fraction("block_fraction", self.block_fraction)
            if self.blocks_per_layer is not None:
                raise UsageError("give --blocks-per-layer or --block-fraction, not both")
        _one_of("block_metric", self.block_metric, METRICS)
        _one_of("block_selection", self.block_selection, SELECTIONS)
        _fraction("element_fraction", self.element_fraction)
        if self.warmup_steps is not None:
            _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("block_size", self.block_size, 1)
        _at_least("dense_below", self.dense_below, 0)
        _at_least("powersgd_rank", self.powersgd_rank, 1)
        _positive("clip_norm", self.clip_norm)
        _positive("sparse_lr_scale", self.sparse_lr_scale)

    def default_lr_scale(self) -> float:
        """What the model's default rate is multiplied by when ``--lr`` is not given: ``sparse_lr_scale``
        for a sparse compressor, else 1."""
        return self.sparse_lr_scale if self.name in ("blocktopk", "topk", "randomk") else 1.0

    def warmup(self) -> int:
        """``--warmup-steps``, or its default: a density ramp for a compressor that sends a share."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ramps = self.name in ("topk", "randomk") or (self.name == "blocktopk" and self.block_fraction)
        return SPARSE_WARMUP_STEPS if ramps else 0


@dataclass
class ParallelConfig:
    """Processes and how the model is laid out over them."""

    nproc: int = _opt(2, "local worker processes to spawn (ignored under torchrun)")
    layout: str = _opt("data", "parallel layout: data, or hybrid (conv layers data-parallel on "
                       "--conv-workers, the FC head on --fc-workers)", flag="parallel")
    conv_workers: int | None = _opt(None, "hybrid: I, the ranks 0..I-1 that train the conv layers", count=True)
    fc_workers: int | None = _opt(None, "hybrid: J, the ranks I..I+J-1 that train the FC head (I divisible by J)",
                                  count=True)
    split_at: str | None = _opt(None, "hybrid: the child module where the FC head begins "
                                "(default: the model's classifier, or its first Flatten/Linear after the last conv)")
    sub_batches: int = _opt(1, "hybrid: send activations in K pieces so the link overlaps the FC "
                            "head's compute (at most --batch-size)", count=True)

    def validate(self) -> None:
        from convoy.parallel import PARALLEL_NAMES, HybridRoles

        _check_fields(self)
        _within("nproc", self.nproc, 1, max_local_processes())
        _one_of("parallel", self.layout, PARALLEL_NAMES)
        _at_least("sub_batches", self.sub_batches, 1)
        if self.layout != "hybrid":
            if self.conv_workers is not None or self.fc_workers is not None or self.sub_batches != 1:
                raise UsageError("--conv-workers, --fc-workers and --sub-batches need --parallel hybrid")
            return
        if self.conv_workers is None or self.fc_workers is None:
            raise UsageError("--parallel hybrid needs --conv-workers I and --fc-workers J")
        HybridRoles(self.conv_workers, self.fc_workers)


@dataclass
class CheckpointConfig:
    """Checkpoints, resuming, and initial weights."""

    dir: str | None = _opt(None, "checkpoint layer by layer into this directory (a DAX/pmem "
                           "mount is used as such); resumes from it when it holds a checkpoint",
                           flag="checkpoint_dir", path=True)
    every: str | int = _opt("1", "checkpoint every N steps (and after the last one), or auto: measure "
                      "a checkpoint's cost and checkpoint as often as --checkpoint-budget allows",
                      flag="checkpoint_every")
    budget: float = _opt(0.03, "--checkpoint-every auto, --checkpoint-full-every auto: the share of step "
                         "time checkpoints may cost, in (0, 0.5]", flag="checkpoint_budget")
    full_every: str | int = _opt("auto", "with a sparse compressor (blocktopk, topk, randomk): a full snapshot "
                                 "every N checkpoints, the exchanged update in between (1: always full), or "
                                 "auto: measure the first full snapshot, then the fewest checkpoints between "
                                 "full ones (10 to 100) that keep within --checkpoint-budget; a resume may "
                                 "train up to that many steps again", flag="checkpoint_full_every")
    resume: bool | None = _opt(None, "resume from --checkpoint-dir (--resume: fail if it holds none; "
                               "--no-resume: start over, overwriting it); default: resume if it holds one")
    init_from: str | None = _opt(None, "start from the parameters of this state_dict file (.pt), e.g. "
                                 "from convoy checkpoint export", path=True)

    def validate(self) -> None:
        """The values; the directory itself is created and checked last, by TrainConfig.validate."""
        _check_fields(self)
        self.every = _count_or_auto("checkpoint_every", self.every)
        if not 0.0 < self.budget <= 0.5:
            raise UsageError(f"--checkpoint-budget must be in (0, 0.5], got {self.budget:g}")
        self.full_every = _count_or_auto("checkpoint_full_every", self.full_every)
        if self.resume is not None and self.dir is None:
            raise UsageError("--resume/--no-resume needs --checkpoint-dir")
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise UsageError(f"--init-from {self.init_from} does not exist")


def _section(kind: type, about: str) -> Any:
    return field(default_factory=kind, metadata={"help": about})


@dataclass
class TrainConfig:
    """A training job: one object per section, in the order ``convoy train --help`` shows them.

    Build one from flat settings named as their flags with ``from_flat``, from
    the nested dict of a run folder's config.json with ``from_dict``, or from
    the sections themselves::

        TrainConfig(optim=OptimConfig(lr=0.1), run=RunConfig(steps=20))
    """

    model: ModelConfig = _section(ModelConfig, "the network to train")
    data: DataConfig = _section(DataConfig, "the dataset and how it is batched")
    optim: OptimConfig = _section(OptimConfig, "optimizer and learning rate")
    run: RunConfig = _section(RunConfig, "length, evaluation, output and the worker processes")
    sync: SyncConfig = _section(SyncConfig, "how workers exchange gradients (allreduce, hierarchical, ps)")
    compress: CompressConfig = _section(CompressConfig, "gradient compression and error feedback")
    parallel: ParallelConfig = _section(ParallelConfig, "processes and how the model is laid out over them")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpoints, resuming, and initial weights")

    @classmethod
    def from_flat(cls, **values: Any) -> "TrainConfig":
        """A config from settings named as their flags, without the dashes; the others keep their defaults.

        Example::

            TrainConfig.from_flat(compress="blocktopk", block_fraction=0.01, checkpoint_dir="ckpt")
        """
        by_name = settings_by_name()
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            if name not in by_name:
                raise TypeError(f"unknown setting {name!r}" + did_you_mean(name, by_name))
            setting = by_name[name]
            sections[setting.section][setting.attr] = value
        return cls.from_dict(sections)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> "TrainConfig":
        """The config ``to_dict`` returned (a run folder's config.json): one dict per section."""
        return cls(**{f.name: _SECTION_TYPES[f.name](**values.get(f.name, {})) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """One dict per section, field by field: what config.json holds and ``from_dict`` reads back."""
        return dataclasses.asdict(self)

    def sections(self) -> Iterator[Any]:
        """The section objects, in the order of ``SECTIONS``."""
        return (getattr(self, name) for name in SECTIONS)

    def world_size(self) -> int:
        """The job's processes: torchrun's WORLD_SIZE under torchrun (or an emulated cluster), else --nproc."""
        from convoy.runtime import launched_by_torchrun

        return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.parallel.nproc

    def validate(self) -> "TrainConfig":
        """Raise UsageError naming the first bad setting; return self when all are good.

        Names are checked here, before any worker starts; import paths only
        resolve inside the workers, where the user's modules are imported.
        """
        for section in self.sections():
            section.validate()
        self._validate_precision()
        if self.parallel.layout == "hybrid" and self.parallel.sub_batches > self.data.batch_size:
            raise UsageError(f"--sub-batches ({self.parallel.sub_batches}) must be at most --batch-size "
                             f"({self.data.batch_size})")
        world = self.world_size()
        self._validate_hierarchical(world)
        self._validate_ps(world)
        self._validate_shape(world)
        if self.checkpoint.dir is not None:   # last: it creates the directory, which a refused job must not leave
            from convoy.checkpoint.session import check_directory

            check_directory(self.checkpoint.dir)
        return self

    def _validate_shape(self, world: int) -> None:
        """Roles and groups fit the world (convoy.parallel.shape), checked before any worker starts."""
        self.job_shape(world)

    def job_shape(self, world_size: int) -> "JobShape":
        """The shape this configuration asks for on ``world_size`` ranks (UsageError where it does not fit)."""
        from convoy.cluster.clustering import parse_clusters
        from convoy.parallel.shape import JobShape

        hybrid = self.parallel.layout == "hybrid"
        servers = self.ps_servers() if self.sync.strategy == "ps" else 0
        return JobShape(world_size,
                        # only dedicated server ranks change the shape; colocated ones are workers too
                        servers=0 if servers == "colocated" else int(servers),
                        conv_workers=(self.parallel.conv_workers or 0) if hybrid else 0,
                        fc_workers=(self.parallel.fc_workers or 0) if hybrid else 0,
                        clusters=parse_clusters(self.sync.clusters) if self.sync.strategy == "hierarchical" else 1)

    def _validate_precision(self) -> None:
        if self.optim.lr is None:
            self.optim.lr = DEFAULT_LR.get(self.model.name, OTHER_MODELS_LR) * self.compress.default_lr_scale()
        _positive("lr", self.optim.lr)
        _one_of("amp", self.optim.amp, AMP_NAMES)
        _at_least("grad_accum", self.optim.grad_accum, 1)
        if self.optim.clip_grad_norm is not None:
            _positive("clip_grad_norm", self.optim.clip_grad_norm)
        self.run.logger = tuple(self.run.logger)
        for name in self.run.logger:
            _one_of("logger", name, LOGGER_NAMES)
        if self.optim.amp == "fp16" and self.compress.name != "none":
            # The compressor's error feedback (and momentum correction's clipping and
            # weight decay) would work on gradients still multiplied by the loss scale,
            # and an overflowed step's infinities would stay in its memory.
            raise UsageError(f"--amp fp16 with --compress {self.compress.name}: error feedback would keep the "
                             "loss-scaled gradient (and an overflowed step's inf); use --amp bf16, which needs no "
                             "loss scale, or --compress none")

    def ps_servers(self) -> int | str:
        """``--servers`` as the job runs it: ``"colocated"``, or S dedicated server ranks.

        Colocated servers are the default of data parallelism; a hybrid job
        keeps its conv and FC ranks and defaults to one dedicated server.
        """
        if self.sync.servers is not None:
            return self.sync.servers
        return 1 if self.parallel.layout == "hybrid" else "colocated"

    def _validate_colocated(self, world: int) -> None:
        if world < 2:
            raise UsageError(f"--servers colocated needs at least 2 processes, got {world}; give --nproc 2 or "
                             "more, or train on one process without --sync ps")
        if self.parallel.layout != "data":
            raise UsageError("--servers colocated needs --parallel data; a hybrid job takes --servers S "
                             "dedicated server ranks")
        if self.sync.staleness:
            self._validate_stale()
        weights = self.sync.shard_weights
        if weights and len(weights) != world:
            raise UsageError(f"--shard-weights needs one share per process ({world}), got {len(weights)}")
        if self.optim.clip_grad_norm is not None or self.optim.amp == "fp16":
            raise UsageError("--clip-grad-norm and --amp fp16 are not supported with --servers colocated yet; "
                             "give --servers S (dedicated servers) or leave them out")

    def _validate_stale(self) -> None:
        staleness = f"--staleness {self.sync.staleness}"
        if self.compress.name != "none":
            raise UsageError(f"{staleness} with --compress {self.compress.name}: compressed pushes are not supported "
                             "under bounded staleness yet; give --compress none or --staleness 0")
        if self.checkpoint.dir is not None:
            raise UsageError(f"{staleness} with --checkpoint-dir: checkpoints of a stale job are not supported yet "
                             "(each rank's shard is up to S steps ahead of its worker); give --staleness 0")

    def _validate_ps(self, world: int) -> None:
        if self.sync.strategy != "ps":
            return
        servers = self.ps_servers()
        if servers == "colocated":
            self._validate_colocated(world)
        else:
            for flag, given in (("--staleness", self.sync.staleness), ("--shard-weights", self.sync.shard_weights)):
                if given:
                    raise UsageError(f"{flag} needs --servers colocated")
        if servers != "colocated" and servers >= world:
            raise UsageError(f"--servers ({servers}) must be smaller than the number of processes ({world}): "
                             "at least one rank must be a worker")
        conv, fc = self.parallel.conv_workers, self.parallel.fc_workers
        if self.parallel.layout == "hybrid" and conv and fc and conv + fc + int(servers) != world:
            raise UsageError(f"--parallel hybrid --sync ps needs --nproc = --conv-workers + --fc-workers + --servers "
                             f"= {conv + fc + servers} (the servers are the last ranks), got {world}")
        if self.compress.block_selection == "global" and self.compress.name == "blocktopk":
            raise UsageError("--block-selection global needs every rank to agree on the blocks (an all-reduce); "
                             "a parameter server decodes each push alone: use --block-selection local with --sync ps")
        if self.checkpoint.dir is not None and (servers not in (1, "colocated") or self.parallel.layout != "data"):
            raise UsageError("--checkpoint-dir with --sync ps needs --servers colocated or 1 and --parallel data (the "
                             "workers' rank files commit in step with the servers' files)")

    def _validate_hierarchical(self, world: int) -> None:
        from convoy.cluster.options import check_cluster_options

        if self.sync.strategy != "hierarchical":
            return
        sync = self.sync
        check_cluster_options(world, sync.clusters, sync.indicator_weights, sync.node_profile, sync.reelect_every,
                              sync.server_choice)


SECTIONS: dict[str, str] = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
_SECTION_TYPES: dict[str, type] = {f.name: f.default_factory  # type: ignore[misc]
                                   for f in dataclasses.fields(TrainConfig)}


@dataclass(frozen=True)
class Setting:
    """One setting: the field ``attr`` of section ``section``, known outside as ``name``.

    ``name`` is the flat name: ``--name`` with - for _ is its flag, and it is
    its key at the top level of a config file.
    """

    section: str
    field: dataclasses.Field

    @property
    def attr(self) -> str:
        return self.field.name

    @property
    def name(self) -> str:
        return self.field.metadata["flag"] or self.field.name

    @property
    def flag(self) -> str:
        return _flag(self.name)

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def default(self) -> Any:
        return self.field.default

    def get(self, config: TrainConfig) -> Any:
        return getattr(getattr(config, self.section), self.attr)

    def set(self, config: TrainConfig, value: Any) -> None:
        setattr(getattr(config, self.section), self.attr, value)


def config_settings() -> list[Setting]:
    """Every setting, section by section, in the order ``convoy train --help`` lists them."""
    return [Setting(section, f) for section, kind in _SECTION_TYPES.items() for f in dataclasses.fields(kind)]


def settings_by_name() -> dict[str, Setting]:
    """Every setting by its flat name (``clip_grad_norm``, ``checkpoint_dir``)."""
    return {setting.name: setting for setting in config_settings()}


def max_local_processes() -> int:
    """The most worker processes ``--nproc`` may start: MAX_NPROC, or fewer under the process limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    except (ImportError, ValueError, OSError):
        return MAX_NPROC
    # Each worker runs gloo and torch threads, and the user's own processes count too.
    return MAX_NPROC if soft == resource.RLIM_INFINITY else max(1, min(MAX_NPROC, soft // 16))


def max_threads() -> int:
    """The most torch threads per worker: THREADS_PER_CORE per core of this machine."""
    return (os.cpu_count() or 1) * THREADS_PER_CORE


def _check_fields(section: Any) -> None:
    """What the field table says of every section's values: counts up to MAX_COUNT, finite numbers,
    paths not empty; a value past them would hang, crash or exhaust the machine."""
    for f in dataclasses.fields(section):
        name, value = f.metadata["flag"] or f.name, getattr(section, f.name)
        if f.metadata["count"] and value is not None and value > MAX_COUNT:
            raise UsageError(f"{_flag(name)} must be <= {MAX_COUNT}, got {value}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{_flag(name)} must be a finite number, got {value}")
        if f.metadata["path"] and isinstance(value, str) and not value.strip():
            raise UsageError(f"{_flag(name)} must not be empty; give a path")


def _check_name(name: str, value: str, choices: tuple[str, ...]) -> None:
    """A built-in name; an import path (``a:b``) is resolved later, where the user's modules are imported."""
    if ":" not in value:
        _one_of(name, value, choices + IMPORT_FORMS)


def _within(name: str, value: int, low: int, high: int) -> None:
    _at_least(name, value, low)
    if value > high:
        raise UsageError(f"{_flag(name)} must be <= {high}, got {value}")


def _count_or_auto(name: str, value: Any) -> int | str:
    """``--checkpoint-every``, ``--checkpoint-full-every``: a whole number in [1, MAX_COUNT], or ``"auto"``."""
    if value == "auto":
        return value
    try:
        count = int(value) if not isinstance(value, (bool, float)) else None
    except ValueError:
        count = None
    if count is None or str(value).strip() not in (str(count), f"+{count}") or not 1 <= count <= MAX_COUNT:
        raise UsageError(f"{_flag(name)} must be a whole number from 1 to {MAX_COUNT}, or auto; got {value!r}")
    return count


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise UsageError(f"{_flag(name)} must be >= {low}, got {value}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UsageError(f"{_flag(name)} must be > 0, got {value}")


def _fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise UsageError(f"{_flag(name)} must be in (0, 1], got {value}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {_flag(name)} {value!r}; choose one of: {', '.join(choices)}"
                         + did_you_mean(value, choices))


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file into flat settings: flat keys, or keys inside their [section] tables; - or _ alike.

    ``lr = 0.1`` at the top and ``[optim]`` ``lr = 0.1`` are the same
    setting; in a table a field's own name works too (``[checkpoint]``
    ``dir = "ckpt"`` is ``checkpoint_dir = "ckpt"``), so the sections of a run
    folder's config.json, written as TOML, are a config file. A key in another
    section's table, an unknown key, or one setting given twice is an error.
    """
    values: dict[str, Any] = {}
    for key, value in read_toml(path, "config file").items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                _put(path, values, _known_key(path, inner, key), inner_value)
        else:
            _put(path, values, _known_key(path, key, None), value)
    return values


def _put(path: str, values: dict[str, Any], name: str, value: Any) -> None:
    if name in values:
        raise UsageError(f"config file {path}: {name} is given twice")
    values[name] = value


def _known_key(path: str, key: str, section: str | None) -> str:
    """The flat name of config-file key ``key``, found at the top level or in ``[section]``."""
    by_name = settings_by_name()
    name = key.replace("-", "_")
    if section is None:
        if name not in by_name:
            raise UsageError(f"config file {path}: unknown key {key!r}; valid keys: {', '.join(by_name)}"
                             + did_you_mean(name, by_name))
        return name
    here = {s.attr: s for s in by_name.values() if s.section == section}
    here.update({s.name: s for s in here.values()})
    if name in here:
        return here[name].name
    if name in by_name:
        raise UsageError(f"config file {path}: {key!r} belongs in [{by_name[name].section}], not [{section}]")
    raise UsageError(f"config file {path}: unknown key [{section}] {key!r}; valid keys: "
                     f"{', '.join(s.attr for s in config_settings() if s.section == section)}"
                     + did_you_mean(name, here))


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, then the file, then the flags the user actually gave; both by flat name."""
    config = TrainConfig.from_flat(**{**file_values, **flag_values})
    for setting in config_settings():
        value = setting.get(config)
        if value is None:
            continue
        kinds = value_types(setting)
        if tuple in kinds and isinstance(value, list):   # a TOML list
            value = tuple(value)
            setting.set(config, value)
        if kinds == (float,) and isinstance(value, int) and not isinstance(value, bool):
            setting.set(config, float(value))
        elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UsageError(f"{setting.name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return config.validate()


def value_types(setting: Setting) -> tuple[type, ...]:
    """The types a setting's value may have, from its annotation (``str | int`` -> (str, int)); the first
    is the one a flag's text is converted to."""
    known = {"bool": bool, "int": int, "float": float, "str": str}
    parts = (part.strip() for part in str(setting.field.type).split("|"))
    return tuple(tuple if part.startswith("tuple") else known[part] for part in parts if part != "None")


def save_config(config: TrainConfig, out_dir: Path) -> None:
    """Write config.json into the run folder: one object per section, as ``TrainConfig.from_dict`` reads it."""
    import json

    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
