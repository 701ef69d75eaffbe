"""Every setting of a training job, with its default, help text and check.

The command line and ``--config`` TOML files are both built from this one
table, so a flag and a config key never disagree.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convoy.errors import UsageError
from convoy.utils.suggest import did_you_mean
from convoy.utils.toml import read_toml


OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
LR_SCHEDULE_NAMES = ("constant", "cosine")
AMP_NAMES = ("off", "bf16", "fp16")
LOGGER_NAMES = ("tensorboard", "csv")
# Learning rates at which the built-in models train with the other defaults
# (vgg_fc's large fully connected layers diverge at 0.05 with momentum 0.9).
DEFAULT_LR = {"lenet": 0.03, "vgg_fc": 0.0125, "resnet18": 0.05}
OTHER_MODELS_LR = 0.03   # the default job's rate: a custom model trains like lenet unless told otherwise
# Steps of the density ramp a sparse compressor warms up with unless told otherwise.
SPARSE_WARMUP_STEPS = 100


DEFAULT_EPOCHS = 20  # the default job's length; see bench/results/default_job.md


# The sections of a config, in the order --help shows them: the [section]
# tables of a TOML config and the argument groups of ``convoy train --help``.
SECTIONS: dict[str, str] = {
    "model": "the network to train",
    "data": "the dataset and how it is batched",
    "optim": "optimizer and learning rate",
    "run": "length, evaluation, output and the worker processes",
    "sync": "how workers exchange gradients (allreduce, hierarchical, ps)",
    "compress": "gradient compression and error feedback",
    "parallel": "processes and how the model is laid out over them",
    "checkpoint": "checkpoints, resuming, and initial weights",
}
DEVICE_NAMES = ("cpu", "cuda")


def _opt(default: Any, help: str, *, section: str, **extra: Any) -> Any:
    if section not in SECTIONS:
        raise ValueError(f"unknown config section {section!r}")  # a typo in this table, caught at import
    return field(default=default, metadata={"help": help, "section": section, **extra})


@dataclass
class TrainConfig:
    """A training job. Field names are the TOML keys; ``--batch-size`` is ``batch_size``."""

    nproc: int = _opt(2, "local worker processes to spawn (ignored under torchrun)", section="parallel")
    model: str = _opt("lenet", "lenet, vgg_fc, resnet18, or path/to/file.py:factory or package.module:factory "
                      "returning an nn.Module; the factory gets whichever of in_channels, num_classes, image_size "
                      "(H, W) it declares", section="model")
    dataset: str = _opt("digits", "digits (embedded), mnist, cifar10, synthetic, or path/to/file.py:factory or "
                        "package.module:factory returning a DatasetSplits or a torch Dataset; the factory gets "
                        "data_dir if it declares it", section="data")
    data_dir: str | None = _opt(None, "folder holding the mnist IDX files or the cifar10 python batches",
                                section="data")
    synthetic_shape: str = _opt("3,32,32", "C,H,W of the synthetic dataset's images", section="data")
    # The default job (lenet on digits, 2 workers): chosen by bench/default_job.py, >= 97% for seeds 0-2.
    batch_size: int = _opt(16, "samples per worker per step (per micro-batch with --grad-accum); the global batch "
                                  "is nproc x grad-accum x this", section="data")
    optimizer: str = _opt("sgd", "optimizer, applied layer by layer: " + ", ".join(OPTIMIZER_NAMES)
                          + ", or package.module:Class", section="optim")
    lr: float | None = _opt(None, "learning rate (default per model: "
                            + ", ".join(f"{name} {lr}" for name, lr in DEFAULT_LR.items())
                            + f", others {OTHER_MODELS_LR})", section="optim")
    momentum: float = _opt(0.9, "momentum (sgd, rmsprop)", section="optim")
    weight_decay: float = _opt(5e-4, "L2 weight decay", section="optim")
    lr_schedule: str = _opt("cosine", "learning-rate schedule: " + ", ".join(LR_SCHEDULE_NAMES), section="optim")
    # Mixed precision, accumulation and clipping (data parallelism: --sync allreduce or hierarchical)
    amp: str = _opt("off", "mixed precision: off, bf16 (works on CPU), or fp16 (with dynamic loss scaling)",
                    section="optim")
    grad_accum: int = _opt(1, "micro-batches per step: each worker runs --batch-size samples N times and "
                           "exchanges the summed gradient once (equal to an N-times larger batch)", section="optim")
    clip_grad_norm: float | None = _opt(None, "scale the averaged gradient down to this global L2 norm; a step's "
                                        "updates then wait for all its exchanges", section="optim")
    steps: int | None = _opt(None, "train this many steps (exclusive with --epochs)", section="run")
    epochs: int | None = _opt(None, f"train this many epochs (default {DEFAULT_EPOCHS} when --steps is not given)",
                              section="run")
    eval_every: int = _opt(0, "evaluate on the test set every N steps (0: at the end only)", section="run")
    stop_at_accuracy: float | None = _opt(None, "stop once an evaluation reaches this test accuracy "
                                          "(0..1; needs --eval-every)", section="run")
    seed: int = _opt(0, "seed of the model's initialisation and the data order", section="run")
    out: str | None = _opt(None, "run folder for metrics and the final model (default runs/<time>)", section="run")
    logger: tuple[str, ...] = _opt((), "also log metrics to: tensorboard (events file), csv (metrics.csv); "
                                   "repeatable, a list in TOML; rank 0 only", section="run")
    sync: str = _opt("allreduce", "gradient synchronisation strategy: allreduce, hierarchical or ps", section="sync")
    clusters: str = _opt("auto", "hierarchical: number of node clusters K, or auto (the K with the best "
                         "silhouette score)", section="sync")
    exchange_every: int = _opt(4, "hierarchical: T, batches per exchange cycle; the clusters' parameters are "
                               "combined after every T-th batch", section="sync")
    reelect_every: int = _opt(4, "hierarchical: R, exchange cycles between elections of the clusters' servers",
                              section="sync")
    server_choice: str = _opt("random", "hierarchical: how each cluster's temporary server is elected: random "
                              "(seeded order, rotating) or capable (highest weighted indicators)", section="sync")
    indicator_weights: str | None = _opt(None, "hierarchical: indicator weights as name=value pairs (cpu_mhz, "
                                         "memory_gb, gpu_mhz, gpu_memory_gb, disk_mbps, uplink_mbps) or six "
                                         "numbers; default 1,0.5,1,0.5,0.5,2", section="sync")
    node_profile: str | None = _opt(None, "hierarchical: TOML file of node indicators overriding the measured "
                                    "ones ([all], [hosts.NAME], [ranks.N] tables)", section="sync")
    servers: int | None = _opt(None, "ps: S, the ranks 0..S-1 that serve the parameters (default 1); the other "
                               "ranks are workers", section="sync")
    channels: int | None = _opt(None, "ps: connections (process groups) per server-worker pair (default 2; fifo: 1)",
                                section="sync")
    priority: str = _opt("graph", "ps: transfer order: graph (the next forward's order, traced), timed (also "
                         "weighs measured run and transfer times), or fifo (arrival order, whole tensors)",
                         section="sync")
    slice_kb: float | None = _opt(None, "ps: cut transfers into slices of this many KB (default 256; fifo: whole "
                                  "tensors)", section="sync")
    credit_kb: float | None = _opt(None, "ps: KB a sender keeps in flight at most (default 1024; fifo: no limit)",
                                   section="sync")
    trace: bool = _opt(False, "ps: record a timeline of --trace-steps steps; writes trace.json (Chrome trace) "
                       "into the run folder", section="sync")
    trace_steps: int = _opt(3, "ps: steps the --trace timeline covers (after the first)", section="sync")
    compress: str = _opt("none", "gradient compressor: none, fp16, blocktopk, topk, randomk, powersgd",
                         section="compress")
    blocks_per_layer: int | None = _opt(None, "blocktopk: blocks kept per parameter (default 1; "
                                        "exclusive with --block-fraction)", section="compress")
    block_fraction: float | None = _opt(None, "blocktopk: fraction of each parameter's blocks kept, "
                                        "in (0, 1], at least one", section="compress")
    block_metric: str = _opt("l1", "blocktopk: norm that scores a block: l1 or l2", section="compress")
    block_selection: str = _opt("local", "blocktopk: local (each rank its own blocks, all-gathered) or "
                                "global (scores summed, the same blocks on every rank, all-reduced)",
                                section="compress")
    element_fraction: float = _opt(0.01, "topk, randomk: fraction of each layer's elements sent, in (0, 1]",
                                   section="compress")
    warmup_steps: int | None = _opt(None, "warm-up: blocktopk --block-fraction, topk and randomk send 25%% of "
                                    "each layer at step 0, decaying exponentially to their own share at step "
                                    "N; other compressors send the first N steps uncompressed (default: "
                                    f"{SPARSE_WARMUP_STEPS} for the former, 0 otherwise)",
                                    section="compress")
    # Sparse compression that converges (DGC's fixes)
    block_size: int = _opt(16, "blocktopk: elements per block (exactly: the largest divisor of a parameter's "
                           "size not above N), so small and large layers are cut alike", section="compress")
    # PowerSGD inside the engine
    powersgd_rank: int = _opt(2, "powersgd: R, columns of each layer's factors P and Q (an integer >= 1); a "
                              "layer whose matrix has a side of R or fewer, or that factors would not shrink "
                              "2x, is sent dense", section="compress")
    momentum_masking: bool = _opt(True, "with momentum correction and a sparse compressor: zero the velocity "
                                  "where a value that had waited is sent", section="compress")
    momentum_correction: bool = _opt(True, "blocktopk, topk, randomk, powersgd with sgd and --momentum > 0: accumulate "
                                     "the velocity on each worker and compress that (error feedback on the "
                                     "velocity), applying the average without the optimizer's momentum",
                                     section="compress")
    clip_norm: float = _opt(5.0, "with momentum correction: clip each layer's local gradient to this L2 "
                            "norm / sqrt(workers) before accumulating it", section="compress")
    parallel: str = _opt("data", "parallel layout: data, or hybrid (conv layers data-parallel on "
                         "--conv-workers, the FC head on --fc-workers)", section="parallel")
    conv_workers: int | None = _opt(None, "hybrid: I, the ranks 0..I-1 that train the conv layers",
                                    section="parallel")
    fc_workers: int | None = _opt(None, "hybrid: J, the ranks I..I+J-1 that train the FC head (I divisible by J)",
                                  section="parallel")
    split_at: str | None = _opt(None, "hybrid: the child module where the FC head begins "
                                "(default: the model's classifier, or its first Flatten/Linear after the last conv)",
                                section="parallel")
    sub_batches: int = _opt(1, "hybrid: send activations in K pieces so the link overlaps the FC "
                            "head's compute (at most --batch-size)", section="parallel")
    threads: int = _opt(1, "torch threads per worker", section="run")
    timeout: float = _opt(300.0, "seconds a collective waits for a peer before the job fails", section="run")
    progress: bool = _opt(True, "show a progress bar on rank 0", section="run")
    device: str = _opt("cpu", "cpu (gloo) or cuda (NCCL; each process uses the GPU of its local rank)",
                       section="run")
    checkpoint_dir: str | None = _opt(None, "checkpoint layer by layer into this directory (a DAX/pmem "
                                      "mount is used as such); resumes from it when it holds a checkpoint",
                                      section="checkpoint")
    # checkpoint frequency and differential checkpoints (ckpt-speed)
    checkpoint_every: str = _opt("1", "checkpoint every N steps (and after the last one), or auto: measure "
                                 "a checkpoint's cost and checkpoint as often as --checkpoint-budget allows",
                                 section="checkpoint")
    checkpoint_budget: float = _opt(0.03, "--checkpoint-every auto: the share of step time checkpoints may "
                                    "cost, in (0, 0.5]", section="checkpoint")
    checkpoint_full_every: int = _opt(10, "with a sparse compressor (blocktopk, topk, randomk): a full snapshot "
                                      "every N checkpoints, the exchanged update in between (1: always full)",
                                      section="checkpoint")
    resume: bool | None = _opt(None, "resume from --checkpoint-dir (--resume: fail if it holds none; "
                               "--no-resume: start over, overwriting it); default: resume if it holds one",
                               section="checkpoint")
    init_from: str | None = _opt(None, "start from the parameters of this state_dict file (.pt), e.g. "
                                 "from convoy checkpoint export", section="checkpoint")

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.steps is not None:
            return self.steps
        return (self.epochs or DEFAULT_EPOCHS) * steps_per_epoch

    def warmup(self) -> int:
        """``--warmup-steps``, or its default: a density ramp for a compressor that sends a share."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ramps = self.compress in ("topk", "randomk") or (self.compress == "blocktopk" and self.block_fraction)
        return SPARSE_WARMUP_STEPS if ramps else 0

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

    def validate(self) -> "TrainConfig":
        """Raise UsageError naming the first bad setting; return self when all are good."""
        from convoy.compress import COMPRESS_NAMES
        from convoy.data import DATASET_NAMES
        from convoy.models import MODEL_NAMES
        from convoy.parallel import PARALLEL_NAMES
        from convoy.sync import SYNC_NAMES

        self._validate_bounds()
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
        self._validate_precision()
        if not 0.0 <= self.momentum < 1.0:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        _one_of("sync", self.sync, SYNC_NAMES)
        _one_of("compress", self.compress, COMPRESS_NAMES)
        self._validate_compression()
        _one_of("parallel", self.parallel, PARALLEL_NAMES)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULE_NAMES)
        self._validate_device()
        # Names are checked here, before any worker starts; import paths only
        # resolve inside the workers, where the user's modules are imported.
        for name, value, choices in (("optimizer", self.optimizer, OPTIMIZER_NAMES),
                                     ("model", self.model, MODEL_NAMES),
                                     ("dataset", self.dataset, DATASET_NAMES)):
            if ":" not in value:
                _one_of(name, value, choices + ("file.py:factory", "package.module:factory"))
        self.synthetic_dims()
        self._validate_hybrid()
        self._validate_hierarchical()
        self._validate_ps()
        self._validate_checkpointing()
        self._validate_shape()
        return self

    def _validate_shape(self) -> None:
        """Roles and groups fit the world (convoy.parallel.shape), checked before any worker starts."""
        from convoy.parallel.shape import JobShape
        from convoy.runtime import launched_by_torchrun

        JobShape.from_config(self, int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.nproc)

    def _validate_bounds(self) -> None:
        """Ceilings and finiteness: a value past them would hang, crash or exhaust the machine."""
        _within("nproc", self.nproc, 1, max_local_processes())
        _within("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        _within("threads", self.threads, 1, max_threads())
        _within("seed", self.seed, 0, MAX_SEED)
        for name in ("steps", "epochs", "eval_every", "checkpoint_full_every", "trace_steps", "warmup_steps",
                     "exchange_every", "reelect_every", "sub_batches", "blocks_per_layer", "servers",
                     "channels", "conv_workers", "fc_workers", "powersgd_rank"):
            value = getattr(self, name)
            if value is not None and value > MAX_COUNT:
                raise UsageError(f"{_flag(name)} must be <= {MAX_COUNT}, got {value}")
        for f in config_fields():
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{_flag(f.name)} must be a finite number, got {value}")
            if isinstance(value, str) and f.name in _PATH_FIELDS and not value.strip():
                raise UsageError(f"{_flag(f.name)} must not be empty; give a path")
        if self.timeout > MAX_TIMEOUT_S:
            raise UsageError(f"--timeout must be <= {MAX_TIMEOUT_S:g} seconds, got {self.timeout:g}")
        _positive("timeout", self.timeout)

    def _validate_precision(self) -> None:
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.model, OTHER_MODELS_LR)
        _positive("lr", self.lr)
        _one_of("amp", self.amp, AMP_NAMES)
        _at_least("grad_accum", self.grad_accum, 1)
        if self.clip_grad_norm is not None:
            _positive("clip_grad_norm", self.clip_grad_norm)
        self.logger = tuple(self.logger)
        for name in self.logger:
            _one_of("logger", name, LOGGER_NAMES)

    def _validate_device(self) -> None:
        import torch

        _one_of("device", self.device, DEVICE_NAMES)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")

    def _validate_checkpointing(self) -> None:
        self.checkpoint_every = _checkpoint_every(self.checkpoint_every)
        if not 0.0 < self.checkpoint_budget <= 0.5:
            raise UsageError(f"--checkpoint-budget must be in (0, 0.5], got {self.checkpoint_budget:g}")
        _at_least("checkpoint_full_every", self.checkpoint_full_every, 1)
        if self.resume is not None and self.checkpoint_dir is None:
            raise UsageError("--resume/--no-resume needs --checkpoint-dir")
        if self.checkpoint_dir is not None:
            from convoy.checkpoint.session import check_directory

            check_directory(self.checkpoint_dir)
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise UsageError(f"--init-from {self.init_from} does not exist")

    def _validate_compression(self) -> None:
        from convoy.compress import METRICS, SELECTIONS

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
        _at_least("powersgd_rank", self.powersgd_rank, 1)
        _positive("clip_norm", self.clip_norm)


    def _validate_ps(self) -> None:
        from convoy.ps.settings import check
        from convoy.runtime import launched_by_torchrun

        check(self.servers, self.priority, self.channels, self.slice_kb, self.credit_kb)
        _at_least("trace_steps", self.trace_steps, 1)
        if self.sync != "ps":
            given = [f for f in ("servers", "channels", "slice_kb", "credit_kb") if getattr(self, f) is not None]
            if given or self.priority != "graph" or self.trace:
                raise UsageError("--servers, --channels, --priority, --slice-kb, --credit-kb and --trace need --sync ps")
            return
        world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.nproc
        servers = self.servers or 1
        if servers >= world:
            raise UsageError(f"--servers ({servers}) must be smaller than the number of processes ({world}): "
                             "at least one rank must be a worker")
        if self.parallel == "hybrid" and self.conv_workers and self.fc_workers \
                and self.conv_workers + self.fc_workers + servers != world:
            raise UsageError(f"--parallel hybrid --sync ps needs --nproc = --conv-workers + --fc-workers + --servers "
                             f"= {self.conv_workers + self.fc_workers + servers} (the servers are the last ranks), "
                             f"got {world}")
        if self.block_selection == "global" and self.compress == "blocktopk":
            raise UsageError("--block-selection global needs every rank to agree on the blocks (an all-reduce); "
                             "a parameter server decodes each push alone: use --block-selection local with --sync ps")
        if self.checkpoint_dir is not None and (servers > 1 or self.parallel != "data"):
            raise UsageError("--checkpoint-dir with --sync ps needs --servers 1 and --parallel data (the workers' "
                             "rank files commit in step with one server's file)")

    def _validate_hierarchical(self) -> None:
        from convoy.cluster.options import check_cluster_options
        from convoy.runtime import launched_by_torchrun

        if self.sync != "hierarchical":
            if self.node_profile is not None or self.indicator_weights is not None or self.clusters != "auto":
                raise UsageError("--clusters, --indicator-weights and --node-profile need --sync hierarchical")
            return
        _at_least("exchange_every", self.exchange_every, 1)
        # Under torchrun (or an emulated cluster) the world is the launcher's, not --nproc.
        world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.nproc
        check_cluster_options(world, self.clusters, self.indicator_weights, self.node_profile, self.reelect_every,
                              self.server_choice)

    def _validate_hybrid(self) -> None:
        _at_least("sub_batches", self.sub_batches, 1)
        if self.parallel != "hybrid":
            if self.conv_workers is not None or self.fc_workers is not None or self.sub_batches != 1:
                raise UsageError("--conv-workers, --fc-workers and --sub-batches need --parallel hybrid")
            return
        if self.sub_batches > self.batch_size:
            raise UsageError(f"--sub-batches ({self.sub_batches}) must be at most --batch-size ({self.batch_size})")
        if self.conv_workers is None or self.fc_workers is None:
            raise UsageError("--parallel hybrid needs --conv-workers I and --fc-workers J")
        from convoy.parallel import HybridRoles

        HybridRoles(self.conv_workers, self.fc_workers)


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
_PATH_FIELDS = ("data_dir", "out", "checkpoint_dir", "init_from", "node_profile", "model", "dataset",
                "optimizer")


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


def _within(name: str, value: int, low: int, high: int) -> None:
    _at_least(name, value, low)
    if value > high:
        raise UsageError(f"{_flag(name)} must be <= {high}, got {value}")


def _checkpoint_every(value: Any) -> int | str:
    """``--checkpoint-every``: a whole number of steps in [1, MAX_COUNT], or ``"auto"``."""
    if value == "auto":
        return value
    try:
        every = int(value) if not isinstance(value, (bool, float)) else None
    except ValueError:
        every = None
    if every is None or str(value).strip() not in (str(every), f"+{every}") or not 1 <= every <= MAX_COUNT:
        raise UsageError(f"--checkpoint-every must be a whole number from 1 to {MAX_COUNT}, or auto; got {value!r}")
    return every


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


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file: flat keys, or keys inside their [section] tables; - or _ alike.

    ``lr = 0.1`` at the top and ``[optim]`` ``lr = 0.1`` are the same
    setting; a key in another section's table, or an unknown key, is an error.
    """
    values: dict[str, Any] = {}
    for key, value in read_toml(path, "config file").items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                values[_known_key(path, inner, key)] = inner_value
        else:
            values[_known_key(path, key, None)] = value
    return values


def _known_key(path: str, key: str, section: str | None) -> str:
    known = {f.name: f.metadata["section"] for f in config_fields()}
    name = key.replace("-", "_")
    where = f"[{section}] " if section else ""
    if name not in known:
        raise UsageError(f"config file {path}: unknown key {where}{key!r}; valid keys: {', '.join(known)}"
                         + did_you_mean(name, known))
    if section is not None and known[name] != section:
        raise UsageError(f"config file {path}: {key!r} belongs in [{known[name]}], not [{section}]")
    return name


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, then the file, then the flags the user actually gave."""
    merged = {**file_values, **flag_values}
    config = TrainConfig(**merged)
    for f in config_fields():
        value = getattr(config, f.name)
        if value is None:
            continue
        expected = _base_type(f)
        if expected is tuple and isinstance(value, list):   # a TOML list
            value = tuple(value)
            setattr(config, f.name, value)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UsageError(f"{f.name} must be {expected.__name__}, got {value!r}")
    return config.validate()


def _base_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str), ("tuple", tuple)):
        if text.startswith(name):
            return kind
    raise TypeError(f"unsupported config type {text}")  # pragma: no cover


def save_config(config: TrainConfig, out_dir: Path) -> None:
    import json

    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
