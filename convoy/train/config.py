"""Every setting of a training job, with its default, help text and check.

The command line and ``--config`` TOML files are both built from this one
table, so a flag and a config key never disagree.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convoy.errors import UsageError
from convoy.utils.toml import read_toml


OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
LR_SCHEDULE_NAMES = ("constant", "cosine")
# Steps of the density ramp a sparse compressor warms up with unless told otherwise.
SPARSE_WARMUP_STEPS = 100


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """A training job. Field names are the TOML keys; ``--batch-size`` is ``batch_size``."""

    nproc: int = _opt(2, "local worker processes to spawn (ignored under torchrun)")
    model: str = _opt("lenet", "lenet, vgg_fc, resnet18, or package.module:factory returning an nn.Module")
    dataset: str = _opt("digits", "digits (embedded), mnist, cifar10, synthetic, or package.module:factory")
    data_dir: str | None = _opt(None, "folder holding the mnist IDX files or the cifar10 python batches")
    synthetic_shape: str = _opt("3,32,32", "C,H,W of the synthetic dataset's images")
    batch_size: int = _opt(32, "samples per worker per step; the global batch is nproc x this")
    optimizer: str = _opt("sgd", "optimizer, applied layer by layer: " + ", ".join(OPTIMIZER_NAMES)
                          + ", or package.module:Class")
    lr: float = _opt(0.05, "learning rate")
    momentum: float = _opt(0.9, "momentum (sgd, rmsprop)")
    weight_decay: float = _opt(5e-4, "L2 weight decay")
    lr_schedule: str = _opt("cosine", "learning-rate schedule: " + ", ".join(LR_SCHEDULE_NAMES))
    steps: int | None = _opt(None, "train this many steps (exclusive with --epochs)")
    epochs: int | None = _opt(None, "train this many epochs (default 40 when --steps is not given)")
    eval_every: int = _opt(0, "evaluate on the test set every N steps (0: at the end only)")
    stop_at_accuracy: float | None = _opt(None, "stop once an evaluation reaches this test accuracy "
                                          "(0..1; needs --eval-every)")
    seed: int = _opt(0, "seed of the model's initialisation and the data order")
    out: str | None = _opt(None, "run folder for metrics and the final model (default runs/<time>)")
    sync: str = _opt("allreduce", "gradient synchronisation strategy")
    clusters: str = _opt("auto", "hierarchical: number of node clusters K, or auto (the K with the best "
                         "silhouette score)")
    exchange_every: int = _opt(4, "hierarchical: T, batches per exchange cycle; the clusters' parameters are "
                               "combined after every T-th batch")
    reelect_every: int = _opt(4, "hierarchical: R, exchange cycles between elections of the clusters' servers")
    server_choice: str = _opt("random", "hierarchical: how each cluster's temporary server is elected: random "
                              "(seeded order, rotating) or capable (highest weighted indicators)")
    indicator_weights: str | None = _opt(None, "hierarchical: indicator weights as name=value pairs (cpu_mhz, "
                                         "memory_gb, gpu_mhz, gpu_memory_gb, disk_mbps, uplink_mbps) or six "
                                         "numbers; default 1,0.5,1,0.5,0.5,2")
    node_profile: str | None = _opt(None, "hierarchical: TOML file of node indicators overriding the measured "
                                    "ones ([all], [hosts.NAME], [ranks.N] tables)")
    servers: int | None = _opt(None, "ps: S, the ranks 0..S-1 that serve the parameters (default 1); the other "
                               "ranks are workers")
    channels: int | None = _opt(None, "ps: connections (process groups) per server-worker pair (default 2; fifo: 1)")
    priority: str = _opt("graph", "ps: transfer order: graph (the next forward's order, traced), timed (also "
                         "weighs measured run and transfer times), or fifo (arrival order, whole tensors)")
    slice_kb: float | None = _opt(None, "ps: cut transfers into slices of this many KB (default 256; fifo: whole "
                                  "tensors)")
    credit_kb: float | None = _opt(None, "ps: KB a sender keeps in flight at most (default 1024; fifo: no limit)")
    trace: bool = _opt(False, "ps: record a timeline of --trace-steps steps; writes trace.json (Chrome trace) "
                       "into the run folder")
    trace_steps: int = _opt(3, "ps: steps the --trace timeline covers (after the first)")
    compress: str = _opt("none", "gradient compressor: none, fp16, blocktopk, topk, randomk")
    blocks_per_layer: int | None = _opt(None, "blocktopk: blocks kept per parameter (default 1; "
                                        "exclusive with --block-fraction)")
    block_fraction: float | None = _opt(None, "blocktopk: fraction of each parameter's blocks kept, "
                                        "in (0, 1], at least one")
    block_metric: str = _opt("l1", "blocktopk: norm that scores a block: l1 or l2")
    block_selection: str = _opt("local", "blocktopk: local (each rank its own blocks, all-gathered) or "
                                "global (scores summed, the same blocks on every rank, all-reduced)")
    element_fraction: float = _opt(0.01, "topk, randomk: fraction of each layer's elements sent, in (0, 1]")
    warmup_steps: int | None = _opt(None, "warm-up: blocktopk --block-fraction, topk and randomk send 25%% of "
                                    "each layer at step 0, decaying exponentially to their own share at step "
                                    "N; other compressors send the first N steps uncompressed (default: "
                                    f"{SPARSE_WARMUP_STEPS} for the former, 0 otherwise)")
    # Sparse compression that converges (DGC's fixes)
    block_size: int = _opt(16, "blocktopk: elements per block (exactly: the largest divisor of a parameter's "
                           "size not above N), so small and large layers are cut alike", section="compress")
    momentum_correction: bool = _opt(True, "blocktopk, topk, randomk with sgd and --momentum > 0: accumulate "
                                     "the velocity on each worker and compress that (error feedback on the "
                                     "velocity), applying the average without the optimizer's momentum",
                                     section="compress")
    clip_norm: float = _opt(5.0, "with momentum correction: clip each layer's local gradient to this L2 "
                            "norm / sqrt(workers) before accumulating it", section="compress")
    parallel: str = _opt("data", "parallel layout: data, or hybrid (conv layers data-parallel on "
                         "--conv-workers, the FC head on --fc-workers)")
    conv_workers: int | None = _opt(None, "hybrid: I, the ranks 0..I-1 that train the conv layers")
    fc_workers: int | None = _opt(None, "hybrid: J, the ranks I..I+J-1 that train the FC head (I divisible by J)")
    split_at: str | None = _opt(None, "hybrid: the child module where the FC head begins "
                                "(default: the model's classifier, or its first Flatten/Linear after the last conv)")
    sub_batches: int = _opt(1, "hybrid: send activations in K pieces so the link overlaps the FC "
                            "head's compute (at most --batch-size)")
    threads: int = _opt(1, "torch threads per worker")
    timeout: float = _opt(300.0, "seconds a collective waits for a peer before the job fails")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    checkpoint_dir: str | None = _opt(None, "checkpoint layer by layer into this directory (a DAX/pmem "
                                      "mount is used as such); resumes from it when it holds a checkpoint")
    checkpoint_every: int = _opt(1, "checkpoint every N steps (and after the last one)")
    resume: bool | None = _opt(None, "resume from --checkpoint-dir (--resume: fail if it holds none; "
                               "--no-resume: start over, overwriting it); default: resume if it holds one")
    init_from: str | None = _opt(None, "start from the parameters of this state_dict file (.pt), e.g. "
                                 "from convoy checkpoint export")

    def total_steps(self, steps_per_epoch: int) -> int:
        if self.steps is not None:
            return self.steps
        return (self.epochs or 40) * steps_per_epoch

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
        return dims  # type: ignore[return-value]

    def validate(self) -> "TrainConfig":
        """Raise UsageError naming the first bad setting; return self when all are good."""
        from convoy.compress import COMPRESS_NAMES
        from convoy.data import DATASET_NAMES
        from convoy.models import MODEL_NAMES
        from convoy.parallel import PARALLEL_NAMES
        from convoy.sync import SYNC_NAMES

        _at_least("nproc", self.nproc, 1)
        _at_least("batch_size", self.batch_size, 1)
        _at_least("threads", self.threads, 1)
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
        _positive("lr", self.lr)
        _positive("timeout", self.timeout)
        if not 0.0 <= self.momentum < 1.0:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        _one_of("sync", self.sync, SYNC_NAMES)
        _one_of("compress", self.compress, COMPRESS_NAMES)
        self._validate_compression()
        _one_of("parallel", self.parallel, PARALLEL_NAMES)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULE_NAMES)
        # Names are checked here, before any worker starts; import paths only
        # resolve inside the workers, where the user's modules are imported.
        for name, value, choices in (("optimizer", self.optimizer, OPTIMIZER_NAMES),
                                     ("model", self.model, MODEL_NAMES),
                                     ("dataset", self.dataset, DATASET_NAMES)):
            if ":" not in value:
                _one_of(name, value, choices + ("package.module:factory",))
        self.synthetic_dims()
        self._validate_hybrid()
        self._validate_hierarchical()
        self._validate_ps()
        self._validate_checkpointing()
        return self

    def _validate_checkpointing(self) -> None:
        _at_least("checkpoint_every", self.checkpoint_every, 1)
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
        if self.parallel != "data":
            raise UsageError("--sync ps needs --parallel data")
        if self.compress != "none":
            raise UsageError("--sync ps does not support --compress yet")
        if self.checkpoint_dir is not None:
            raise UsageError("--checkpoint-dir does not support --sync ps yet")

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
        if self.parallel != "data":
            raise UsageError("--sync hierarchical needs --parallel data")
        if self.checkpoint_dir is not None:
            raise UsageError("--checkpoint-dir does not support --sync hierarchical yet")

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
        raise UsageError(f"unknown {_flag(name)} {value!r}; choose one of: {', '.join(choices)}")


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file; keys may be spelt with - or _; unknown keys are errors."""
    raw = read_toml(path, "config file")
    known = {f.name: f for f in config_fields()}
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UsageError(f"config file {path}: unknown key {key!r}; valid keys: {', '.join(known)}")
        values[name] = value
    return values


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, then the file, then the flags the user actually gave."""
    merged = {**file_values, **flag_values}
    config = TrainConfig(**merged)
    for f in config_fields():
        value = getattr(config, f.name)
        if value is None:
            continue
        expected = _base_type(f)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UsageError(f"{f.name} must be {expected.__name__}, got {value!r}")
    return config.validate()


def _base_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    raise TypeError(f"unsupported config type {text}")  # pragma: no cover


def save_config(config: TrainConfig, out_dir: Path) -> None:
    import json

    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
