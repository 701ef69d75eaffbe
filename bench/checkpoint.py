"""Checkpointing every step: convoy's layer-wise pipelined checkpoints against torch.save and DCP async_save.

    python bench/checkpoint.py [--models resnet18 vgg_fc] [--steps 8] [--rounds 2] [--batch 16] [--dir /tmp]
                               [--compress none|blocktopk|...] [--modes convoy ...]

Two gloo workers on loopback, one torch thread each, SGD with momentum, the
state checkpointed after every step by:

- none: no checkpoint (the baseline step time);
- convoy: the engine listener: each layer handed over when updated and written
  from the live tensors by a background thread (its next update waits for that),
  one fdatasync per checkpoint (rank 0 writes the model, every rank its state);
  with ``--compress`` differential checkpoints (the sparse update each step, a
  full snapshot as seldom as a budget of 2% of the step time needs, the
  interval measured by the listener: ``full_every="auto"``), and
  ``convoy_full`` the same with a full snapshot every step, and
  ``convoy_replay`` with the ranks' files written only with the full
  snapshots (``rank_files="full"``: a local compressor's residuals are rebuilt
  by replay on the same world; the default writes them every step, so a
  resume on another world goes on from the newest step);
- torch_save: rank 0 calls torch.save of the model and optimizer state after
  each step (synchronous, after engine.synchronize()); nothing is fsynced, so
  the checkpoint may still sit in the page cache when the machine goes down;
- torch_save_fsync: the same written durably, as a user who needs the file
  after a power cut would: a temporary file, fsync, rename, fsync of the folder
  (convoy.utils.atomic.save_atomically); with a compressor every rank also
  saves its error-feedback residuals, which a bit-identical resume needs;
- dcp_async: torch.distributed.checkpoint.async_save of the same tensors after
  each step (one save in flight, its own process group).

Reported per mode: median step time (modes run round-robin, ``--rounds`` times), overhead against none (of the
median, and of the mean step time, which counts the rare slow steps of a full snapshot), the stall on the
training path per checkpoint (convoy: time in the listener on the auxiliary
thread; torch.save: the call; DCP: the call plus waiting for the previous
save), CPU time per step (every thread of each worker's process, less sensitive than the
step time to other jobs on the machine) against none, convoy's CPU time per step on the
training threads (in the listener) and on its persister thread, MB written per checkpoint
(convoy: rank 0's model file and its own state file) and per second, and recovery time (convoy: open, verify every
checksum, copy into a model; torch: torch.load plus load_state_dict). Writes
bench/results/checkpoint.{json,md,png}
(``checkpoint_<compressor>.*`` with ``--compress``: the exchange is then compressed with
error feedback, and convoy writes differential checkpoints).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save, spawn  # noqa: E402
from bench.figures import Block, Row, number, rows_of, seconds, table  # noqa: E402
from bench.engine_vs_ddp import WARMUP, _batch, _model  # noqa: E402
from convoy.checkpoint import CheckpointSettings, start_checkpointing  # noqa: E402
from convoy.checkpoint.fsinfo import fs_info  # noqa: E402
from convoy.checkpoint.recovery import read_updates, replay_updates, restore_model, restore_points, scan  # noqa: E402
from convoy.checkpoint.store import Store  # noqa: E402
from convoy.compress import build_compressor, compressor_names  # noqa: E402
from convoy.engine import Engine  # noqa: E402
from convoy.parallel.groups import ProcessGroups  # noqa: E402
from convoy.parallel.shape import JobShape  # noqa: E402
from convoy.sync import AllReduce  # noqa: E402
from convoy.utils.atomic import save_atomically  # noqa: E402

MODES = ("none", "convoy", "torch_save", "torch_save_fsync", "dcp_async")
COMPRESSED_MODES = ("convoy_full", "convoy_replay")   # with --compress only


def modes(compress: str, only: list[str] | None = None) -> tuple[str, ...]:
    """With compression, also convoy without differential checkpoints (a full snapshot each time);
    ``only``: just these (``none``, the baseline, always)."""
    every = MODES if compress == "none" else MODES[:2] + COMPRESSED_MODES + MODES[2:]
    return tuple(m for m in every if only is None or m == "none" or m in only)
HYPER = {"lr": 0.01, "momentum": 0.9}
DIFFERENTIAL_BUDGET = 0.02   # the share of step time a checkpoint riding on compression may cost


def _flat_state(model, engine) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for layer, opt in zip(engine.layers, engine.optimizers):
        for i, p in enumerate(layer.params):
            state[f"optim.{layer.name}.{i}"] = opt.state[p]["momentum_buffer"]
    return state


def _torch_state(rank: int, model, engine) -> dict:
    """What torch.save writes on ``rank``: the model and optimizers (rank 0) and the rank's sync state."""
    state = {"sync": engine.sync.state_tensors()}
    if rank == 0:
        state.update(model=model.state_dict(), optimizers=engine.optimizer_state())
    return state


def _run_mode(rank: int, mode: str, name: str, batch: int, steps: int, root: Path, compress: str) -> dict:
    x, y = _batch(rank, batch, 3)
    model = _model(name, 3)
    compressor, memory = build_compressor(compress)
    # The job's groups as convoy train makes them: the engine's, and the one its ranks agree on "auto" over.
    groups = ProcessGroups.create(JobShape(dist.get_world_size()), agree_full=True)
    engine = Engine(model, torch.optim.SGD, AllReduce(groups.engines[0], compressor, memory), **HYPER)
    directory = root / mode
    session, stalls, pending = None, [], [None]
    if mode.startswith("convoy"):
        full_every = 1 if mode == "convoy_full" else CheckpointSettings.full_every
        settings = CheckpointSettings(str(directory), resume=False, full_every=full_every, budget=DIFFERENTIAL_BUDGET,
                                      rank_files="full" if mode == "convoy_replay" else CheckpointSettings.rank_files)
        session = start_checkpointing(settings, model, engine,
                                      torch.optim.SGD, HYPER, total_steps=10**9, steps_per_epoch=10**9,
                                      agree_groups=(groups.agree_every, groups.agree_full))
    dcp_group = dist.new_group() if mode == "dcp_async" else None

    def step() -> None:
        engine.backward(F.cross_entropy(model(x), y))
        if mode in ("torch_save", "torch_save_fsync", "dcp_async"):
            engine.synchronize()
            start = time.perf_counter()
            state = _torch_state(rank, model, engine) if mode.startswith("torch_save") else {}
            if mode == "torch_save" and (rank == 0 or state["sync"]):
                directory.mkdir(parents=True, exist_ok=True)
                torch.save(state, directory / f"state{rank}.pt")
            elif mode == "torch_save_fsync" and (rank == 0 or state["sync"]):
                directory.mkdir(parents=True, exist_ok=True)
                save_atomically(state, directory / f"state{rank}.pt")
            elif mode == "dcp_async":
                import torch.distributed.checkpoint as dcp
                if pending[0] is not None:
                    pending[0].result()
                pending[0] = dcp.async_save(_flat_state(model, engine), checkpoint_id=str(directory / f"s{engine.step}"),
                                            process_group=dcp_group)
            stalls.append(time.perf_counter() - start)

    def finish() -> None:
        engine.synchronize()
        if session is not None:
            session.listener.flush()

    times, cpu = _timed(step, finish, steps)
    if pending[0] is not None:
        pending[0].result()
    engine.close()
    out = {"times": times, "cpu_s": cpu, "stall_s": statistics.mean(stalls) if stalls else 0.0}
    if session is not None:
        stats = session.listener.stats
        session.listener.close()
        out["stall_s"] = stats["stall_s"] / max(stats["commits"] or steps, 1)
        # Per step, warm-up included (the listener's counters start with the run).
        out["path_cpu_s"] = stats["path_cpu_s"] / (steps + WARMUP)
        out["persist_cpu_s"] = stats["persist_cpu_s"] / (steps + WARMUP)
        out["bytes_per_step"] = stats["bytes_written"] / max(stats["commits"], 1)
        if rank == 0:
            out["recovery_s"] = _best_of(3, lambda: _convoy_recovery(directory, model))
    elif mode.startswith("torch_save") and rank == 0:
        out["bytes_per_step"] = sum(f.stat().st_size for f in directory.glob("state*.pt"))
        out["recovery_s"] = _best_of(3, lambda: _torch_recovery(directory / "state0.pt", model))
    elif mode == "dcp_async":
        out["bytes_per_step"] = sum(f.stat().st_size for f in (directory / f"s{engine.step}").glob("*"))
    return out


def _timed(step, finish, steps: int) -> tuple[list[float], float]:
    """Each step's wall time (the drain added to the last) and the CPU seconds per step of every
    thread of the process (less sensitive to other jobs on the machine than the wall time)."""
    for _ in range(WARMUP):
        step()
    finish()
    times, cpu = [], time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    finish()
    times[-1] += time.perf_counter() - start
    return times, (time.process_time() - cpu) / steps


def _best_of(repeats: int, action) -> float:
    """The fastest of ``repeats`` timed calls (the page cache is warm for both methods)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def _convoy_recovery(directory: Path, model) -> None:
    path = directory / "model-rank0.ckpt"
    store = Store.open(path)
    points = restore_points(path, scan(store, verify_all=False))   # as a resume does
    point = points[max(points)]
    states = restore_model(store, point.report.area, model)
    store.close()
    replay_updates(model, torch.optim.SGD, HYPER, states, read_updates(path, point))


def _torch_recovery(path: Path, model) -> None:
    model.load_state_dict(torch.load(path)["model"])


def worker(rank: int, world: int, name: str, batch: int, steps: int, root: str, rounds: int, compress: str,
           only: list[str] | None = None) -> dict:
    """Every mode ``rounds`` times, round-robin, so load from other jobs spreads over all of them.

    Each round starts one mode later in the list, so no mode always follows the same one, and
    before each mode the previous one's dirty pages are flushed (``os.sync``): torch.save without
    fsync leaves its writes to the kernel, which would otherwise write them back while the next
    mode is timed.
    """
    results: dict[str, dict] = {}
    order = modes(compress, only)
    for round_ in range(rounds):
        for mode in order[round_ % len(order):] + order[:round_ % len(order)]:
            dist.barrier()
            if rank == 0:   # a fresh directory each round: no run reads another's files
                shutil.rmtree(Path(root) / mode, ignore_errors=True)
            os.sync()
            dist.barrier()
            out = _run_mode(rank, mode, name, batch, steps, Path(root), compress)
            merged = results.setdefault(mode, {"times": [], "cpu_s": [], "stall_s": [], "recovery_s": [],
                                               "path_cpu_s": [], "persist_cpu_s": []})
            merged["times"] += out["times"]
            merged["cpu_s"].append(out["cpu_s"])
            for key in ("path_cpu_s", "persist_cpu_s"):
                if key in out:
                    merged[key].append(out[key])
            merged["stall_s"].append(out["stall_s"])
            merged["bytes_per_step"] = out.get("bytes_per_step", 0)
            if "recovery_s" in out:
                merged["recovery_s"].append(out["recovery_s"])
    return results


def _plot(timelines: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(timelines), figsize=(6 * len(timelines), 4), squeeze=False)
    for ax, (model, modes) in zip(axes[0], timelines.items()):
        for mode, times in modes.items():
            ax.plot(range(1, len(times) + 1), times, marker="o", label=mode)
        ax.set_title(f"{model}, 2 workers: step time, checkpoint every step")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "vgg_fc"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="times each mode runs, round-robin")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--tag", default="", help="suffix of the result files' name (a paired run of a few modes)")
    parser.add_argument("--compress", default="none", choices=compressor_names(),
                        help="compress the exchange (with error feedback); convoy then writes differential checkpoints")
    parser.add_argument("--modes", nargs="+", choices=MODES + COMPRESSED_MODES,
                        help="run only these modes (and none, the baseline); default: all")
    args = parser.parse_args()
    rows, timelines, load_before = [], {}, os.getloadavg()[0]
    for name in args.models:
        root = Path(tempfile.mkdtemp(prefix="convoy-bench-ckpt-", dir=args.dir))
        try:
            results = spawn(worker, 2, name, args.batch, args.steps, str(root), args.rounds, args.compress,
                            args.modes)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        base = statistics.median(t for r in results for t in r["none"]["times"])
        base_mean = statistics.mean(t for r in results for t in r["none"]["times"])
        base_cpu = statistics.median(c for r in results for c in r["none"]["cpu_s"])
        timelines[name] = {mode: results[0][mode]["times"] for mode in modes(args.compress, args.modes)}
        for mode in modes(args.compress, args.modes):
            step_s = statistics.median(t for r in results for t in r[mode]["times"])
            per_step = results[0][mode].get("bytes_per_step", 0)
            recovery = results[0][mode]["recovery_s"]
            cpu = statistics.median(c for r in results for c in r[mode]["cpu_s"])
            path_cpu = [c for r in results for c in r[mode]["path_cpu_s"]]
            persist_cpu = [c for r in results for c in r[mode]["persist_cpu_s"]]
            rows.append({"model": name, "mode": mode, "median_step_s": step_s,
                         "overhead_%": 100 * (step_s / base - 1),
                         "mean_overhead_%": 100 * (statistics.mean(t for r in results for t in r[mode]["times"])
                                                   / base_mean - 1),
                         "cpu_per_step_s": cpu, "cpu_overhead_%": 100 * (cpu / base_cpu - 1),
                         "path_cpu_ms": 1000 * statistics.median(path_cpu) if path_cpu else "",
                         "persist_cpu_ms": 1000 * statistics.median(persist_cpu) if persist_cpu else "",
                         "stall_ms": 1000 * statistics.median(results[0][mode]["stall_s"]),
                         "MB_per_ckpt": per_step / 1e6, "MB_written_per_s": per_step / 1e6 / step_s,
                         "recovery_s": min(recovery) if recovery else ""})
    settings = {"models": args.models, "steps": args.steps, "rounds": args.rounds, "batch_per_worker": args.batch, "world": 2,
                "compress": args.compress,
                "optimizer": "sgd momentum", "checkpoint_fs": fs_info(args.dir).describe(),
                "note": "2-core machine shared with other jobs: figures are noisy",
                "load_average_1min": [load_before, os.getloadavg()[0]]}
    stem = "checkpoint" if args.compress == "none" else f"checkpoint_{args.compress}"
    stem += f"_{args.tag}" if args.tag else ""
    save(stem, settings, rows, ["model", "mode", "median_step_s", "overhead_%", "mean_overhead_%", "cpu_overhead_%",
                                "path_cpu_ms", "persist_cpu_ms", "stall_ms", "MB_per_ckpt", "MB_written_per_s", "recovery_s"])
    _plot(timelines, RESULTS / f"{stem}.png")


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_checkpoint(name: str) -> str:
    """One result file's modes against no checkpoint: the step, the CPU, the listener's share, the stall."""
    def cpu(r: Row) -> str:
        return "" if r["mode"] == "none" or "cpu_overhead_%" not in r else f"{r['cpu_overhead_%']:+.1f}%"

    def listener(r: Row) -> str:
        return "" if r.get("path_cpu_ms") in (None, "") else f"{r['path_cpu_ms']:.3g} / {r['persist_cpu_ms']:.3g} ms"

    def mean(r: Row) -> str:   # rows measured before the column was added have none
        return "" if r["mode"] == "none" or "mean_overhead_%" not in r else f"{r['mean_overhead_%']:+.1f}%"

    return table(["model", "mode", "median step", "overhead", "overhead of the mean step", "CPU overhead",
                  "listener CPU / step (training / persister)", "stall / ckpt", "MB / ckpt", "recovery"],
                 [[r["model"], r["mode"], seconds(r["median_step_s"]),
                   "" if r["mode"] == "none" else f"{r['overhead_%']:+.1f}%", mean(r), cpu(r), listener(r),
                   "" if r["mode"] == "none" else f"{r['stall_ms']:.3g} ms",
                   "" if r["mode"] == "none" else number(r["MB_per_ckpt"]),
                   seconds(r.get("recovery_s"), missing="")] for r in rows_of(name)])


BLOCKS = (
    Block("checkpoint", "Checkpointing every step", ("checkpoint",),
          "torch.save and torch.distributed.checkpoint's async_save every step; torch.load for recovery",
          partial(render_checkpoint, "checkpoint"),
          rerun="python bench/checkpoint.py --models resnet18 --steps 10 --rounds 2"),
    Block("checkpoint_blocktopk", "Checkpointing every step under blocktopk (differential checkpoints)",
          ("checkpoint_blocktopk",), "torch.save with fsync every step, each rank's residuals included",
          partial(render_checkpoint, "checkpoint_blocktopk"),
          rerun="python bench/checkpoint.py --models resnet18 --steps 10 --rounds 2 --compress blocktopk"),
    Block("checkpoint_blocktopk_ab", "Differential checkpoints against none, paired (blocktopk)",
          ("checkpoint_blocktopk_ab",), "no checkpoint, the two modes alternating twenty times",
          partial(render_checkpoint, "checkpoint_blocktopk_ab"),
          rerun="python bench/checkpoint.py --models resnet18 --steps 10 --rounds 20 --compress blocktopk "
                "--modes none convoy --tag ab"),
    Block("checkpoint_blocktopk_long", "Differential checkpoints against none, long enough for full snapshots",
          ("checkpoint_blocktopk_long",),
          "no checkpoint, alternating; 110 steps a round, so the full snapshots the listener spaces count",
          partial(render_checkpoint, "checkpoint_blocktopk_long"),
          rerun="python bench/checkpoint.py --models resnet18 --steps 110 --rounds 3 --compress blocktopk "
                "--modes none convoy --tag long"),
    Block("checkpoint_blocktopk_rank_files", "Rank files every checkpoint against only with the full snapshots "
          "(blocktopk)", ("checkpoint_blocktopk_rank_files",),
          "no checkpoint, the three modes alternating: convoy writes every rank's residuals at every checkpoint "
          "(the default), convoy_replay only with the full snapshots (--checkpoint-rank-files full)",
          partial(render_checkpoint, "checkpoint_blocktopk_rank_files"),
          rerun="python bench/checkpoint.py --models vgg_fc resnet18 --steps 30 --rounds 3 --compress blocktopk "
                "--modes none convoy convoy_replay --tag rank_files"),
)


if __name__ == "__main__":
    main()
