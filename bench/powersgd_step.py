"""Step time of `convoy train --compress powersgd` against DDP + torch's PowerSGD hook, and the compute floor.

    python bench/powersgd_step.py [--models vgg_fc resnet18] [--world 2] [--ranks 1 2 4] [--rounds 12]
                                  [--round-steps 3] [--batch 16] [--tag TAG]
    python bench/powersgd_step.py --hosts 4 --rate 100mbit ...   # as root, under flock /tmp/convoy-netns.lock

One run, loopback gloo (or, with ``--hosts``, one rank per emulated host of ``convoy bench cluster``,
the links shaped to ``--rate``), one torch thread per worker; per model, side by side in the same processes:

- ``floor``: the same ranks, model and batch with no gradient exchange at all (each trains its own
  replica; SGD with momentum and weight decay): the compute floor every exchange is read against;
- ``hook-R``: DDP with torch's ``powerSGD_hook`` at rank R (warm start, error feedback, compressed
  from step 2 so every timed step is; one bucket, as bench/peers/ddp_train.py runs it: with several
  the hook's collectives can come in different orders on gloo);
- ``convoy-R``: what ``convoy train --compress powersgd --powersgd-rank R`` runs, built by its own
  ``build_layout`` (the engine, ``AllReduce`` + ``PowerSGDCompressor`` + momentum correction with
  clipping and weight decay), stepped by its ``train_step``;
- ``convoy_blocking-R`` (with ``--blocking-rounds``): the same with each bucket's P all-reduce blocking
  in ``start`` (``AllReduce.defers_rounds`` off), as the engine ran it before it deferred the round.

The variants run in rounds of ``--round-steps`` steps (each round ends when its exchanges have, and
all ranks start it together); the order of the variants rotates from round to round, so a burst of
load from other jobs hits all of them. A round is as slow as its slowest rank (wall); CPU is the
process CPU time (every thread), the mean over the ranks. ``forward_wait_s`` is how long convoy's next
forward waited for the exchange's updates per step (the exchange left on the critical path). Figures are medians over rounds, the ratios
medians of per-round ratios to the adjacent rounds of the hook at the same R and of the floor.
Writes bench/results/powersgd_step[_TAG].{json,md} (with ``--hosts``, TAG defaults to HOSTShosts_RATE).

``--profile`` instead profiles convoy's step at each R: the auxiliary thread's CPU time per step
(cProfile on that thread, timed by the thread's CPU clock), split into the stages of the exchange;
writes bench/results/powersgd_profile[_TAG].{json,md}. ``--kernels`` times PowerSGD's two products with the
thin factor on either side (bench/results/powersgd_kernels.{json,md}).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import run_on_hosts, save, spawn, timed_round  # noqa: E402
from bench.figures import Block, Row, loaded, number, rows_of, seconds, table, times  # noqa: E402
from convoy import runtime  # noqa: E402
from convoy.models import build_model  # noqa: E402
from convoy.train.config import TrainConfig  # noqa: E402
from convoy.train.loop import build_layout  # noqa: E402

LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.9, 5e-4
# The hook sends the first steps dense; warm-up rounds cover them, so every timed step is compressed.
HOOK_START_ITER = 2
WARMUP_ROUNDS = 2

Step = Callable[[], None]


def _model(name: str, channels: int) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, in_channels=channels, num_classes=10)


def _batch(rank: int, batch: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, channels, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _torch_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        loss.item()   # as convoy's train_step reads its loss
    return step


def _floor(name: str, channels: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, Step]:
    model = _model(name, channels)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    return _torch_step(model, opt, x, y), lambda: None


def _hook(name: str, channels: int, rank: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, Step]:
    net = nn.parallel.DistributedDataParallel(_model(name, channels), bucket_cap_mb=4096)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=HOOK_START_ITER, warm_start=True,
                                        use_error_feedback=True)
    net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    return _torch_step(net, opt, x, y), lambda: None


def _convoy(name: str, channels: int, rank: int, world: int, x: torch.Tensor, y: torch.Tensor,
            batch: int):
    config = TrainConfig.from_flat(model=name, compress="powersgd", powersgd_rank=rank, lr=LR, momentum=MOMENTUM,
                                   weight_decay=WEIGHT_DECAY, batch_size=batch, nproc=world)
    ctx = runtime.Context(dist.get_rank(), world, dist.get_rank(), torch.device("cpu"), "gloo")
    layout = build_layout(config, _model(name, channels), ctx, total_steps=10 ** 6,
                          input_shape=tuple(x.shape[1:]))
    return (lambda: layout.train_step(x, y)), layout.engine.synchronize, layout.engine


def _kinds(blocking: bool) -> tuple[str, ...]:
    return ("hook", "convoy", "convoy_blocking") if blocking else ("hook", "convoy")


def worker(rank: int, world: int, name: str, ranks: list[int], batch: int, steps: int, rounds: int,
           channels: int, blocking: bool) -> dict:
    x, y = _batch(rank, batch, channels)
    variants: dict[str, tuple[Step, Step]] = {"floor": _floor(name, channels, x, y)}
    engines = {}
    for r in ranks:
        variants[f"hook-{r}"] = _hook(name, channels, r, x, y)
        for kind in _kinds(blocking)[1:]:
            step, finish, engine = _convoy(name, channels, r, world, x, y, batch)
            if kind == "convoy_blocking":
                # The A/B switch: each bucket's P all-reduce blocks in start, as before the engine deferred it.
                engine.sync.defers_rounds = False
            variants[f"{kind}-{r}"] = (step, finish)
            engines[f"{kind}-{r}"] = engine
    names = list(variants)
    for _ in range(WARMUP_ROUNDS):
        for v in names:
            timed_round(*variants[v], steps)
    out: dict[str, list] = {v: [] for v in names} | {f"{v}_cpu": [] for v in names}
    for i in range(rounds):
        shift = i % len(names)   # rotate the order so no variant always follows the same one
        for v in names[shift:] + names[:shift]:
            wall, cpu = timed_round(*variants[v], steps)
            out[v].append(wall)
            out[f"{v}_cpu"].append(cpu)
    out["bytes_per_step"] = {v: e.sync.bytes_sent / e.step for v, e in engines.items()}
    out["buckets"] = {v: len(e.buckets) for v, e in engines.items()}
    # How long the next forward waited for updates, per step: the exchange left on the critical path.
    out["forward_wait"] = {v: statistics.median(e.stats(s).wait_s for s in range(WARMUP_ROUNDS * steps, e.step))
                           for v, e in engines.items()}
    for engine in engines.values():
        engine.close()
    return out


def rows_for(name: str, world: int, ranks: list[int], results: list[dict], rounds: int,
             blocking: bool) -> list[dict]:
    """One row per variant: medians over rounds, ratios to the hook at the same R and to the floor."""
    def walls(v: str) -> list[float]:
        return [max(r[v][i] for r in results) for i in range(rounds)]

    def cpus(v: str) -> list[float]:
        return [sum(r[f"{v}_cpu"][i] for r in results) / len(results) for i in range(rounds)]

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(p / q for p, q in zip(a, b))

    floor_wall, floor_cpu = walls("floor"), cpus("floor")
    rows = [{"model": name, "world": world, "variant": "floor", "rank": None, "buckets": 0,
             "step_s": statistics.median(floor_wall), "cpu_s": statistics.median(floor_cpu), "forward_wait_s": None,
             "wall/hook": None, "cpu/hook": None, "wall/floor": 1.0, "cpu/floor": 1.0}]
    for r in ranks:
        hook_wall, hook_cpu = walls(f"hook-{r}"), cpus(f"hook-{r}")
        for kind in _kinds(blocking):
            v = f"{kind}-{r}"
            wall, cpu = walls(v), cpus(v)
            wait = statistics.median(res["forward_wait"][v] for res in results) if kind != "hook" else None
            rows.append({"model": name, "world": world, "variant": kind, "rank": r,
                         "buckets": results[0]["buckets"][v] if kind != "hook" else 1,
                         "step_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "forward_wait_s": wait,
                         "wall/hook": ratio(wall, hook_wall), "cpu/hook": ratio(cpu, hook_cpu),
                         "wall/floor": ratio(wall, floor_wall), "cpu/floor": ratio(cpu, floor_cpu)})
    return rows


def _cumulative(stats: pstats.Stats, where: str, caller: str | None = None) -> float:
    """Seconds spent in ``where`` ("file.py:function", the file a path suffix), and in what it called;
    only the calls from ``caller`` when given."""
    suffix, name = where.split(":")
    total = 0.0
    for (filename, _, function), (_, _, _, cum, callers) in stats.stats.items():   # type: ignore[attr-defined]
        if function != name or not filename.endswith(suffix):
            continue
        if caller is None:
            total += cum
            continue
        c_suffix, c_name = caller.split(":")
        total += sum(c[3] for (f, _, fn), c in callers.items() if fn == c_name and f.endswith(c_suffix))
    return total


def _stage_times(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """CPU ms per step of each stage of convoy's exchange on the auxiliary thread, and of the whole thread."""
    def ms(where: str, caller: str | None = None) -> float:
        return 1000 * _cumulative(stats, where, caller) / steps

    average = ms("sync/allreduce.py:wait", "engine/engine.py:_finish_exchange")
    return {
        "flat parameters (for weight decay)": ms("sync/allreduce.py:start") - ms("sync/allreduce.py:start_flat"),
        "momentum correction (clip, weight decay, velocity)": ms("compress/momentum.py:compensate"),
        "P = M Q": ms("compress/powersgd.py:compress"),
        "P all-reduce": ms("sync/allreduce.py:_agree") + ms("sync/allreduce.py:_agree_async"),
        "orthonormalise P, Q_i = M^T P": ms("compress/powersgd.py:next_round"),
        # before the fused residual: decompress, then subtract (update); after: keep_unsent
        "residual (M_i - P Q_i^T)": (ms("compress/powersgd.py:decompress", "sync/allreduce.py:start_flat")
                                     + ms("compress/momentum.py:update") + ms("compress/momentum.py:keep_unsent")),
        "Q all-reduce (issue)": ms("sync/allreduce.py:_exchange"),
        "average (P Q^T, divide)": average,
        "update (copy, finite check, SGD, zero)": ms("engine/engine.py:_finish_exchange") - average,
        "auxiliary thread, all": ms("engine/engine.py:_run_step"),
    }


def profile_worker(rank: int, world: int, name: str, ranks: list[int], batch: int, steps: int,
                   channels: int) -> dict[int, dict[str, float]]:
    """Each R's convoy step profiled on its auxiliary thread (CPU time), after warm-up steps."""
    x, y = _batch(rank, batch, channels)
    out = {}
    for r in ranks:
        profiler = cProfile.Profile(time.thread_time)

        def start_in_thread(*_: Any) -> None:
            # The first event in the engine's thread (started at the first backward): profile it from here.
            sys.setprofile(None)
            profiler.enable()

        threading.setprofile(start_in_thread)
        step, finish, engine = _convoy(name, channels, r, world, x, y, batch)
        step()
        threading.setprofile(None)   # type: ignore[arg-type]
        for _ in range(WARMUP_ROUNDS * 3):
            step()
        finish()
        dist.barrier()
        profiler.clear()   # cProfile keeps collecting on the thread; count only the timed steps
        for _ in range(steps):
            step()
        finish()
        out[r] = _stage_times(pstats.Stats(profiler), steps)
        engine.close()
    return out


def profile(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    rows = []
    for name in args.models:
        channels = 3 if name == "resnet18" else 1
        results = spawn(profile_worker, args.world, name, args.ranks, args.batch, args.rounds * args.round_steps,
                        channels)
        for r in args.ranks:
            for stage in results[0][r]:
                rows.append({"model": name, "world": args.world, "rank": r, "stage": stage,
                             "cpu_ms_per_step": statistics.mean(res[r][stage] for res in results)})
    settings = {**vars(args), "load_before": list(load_before), "load_after": list(os.getloadavg()),
                "note": "auxiliary thread CPU ms per step (cProfile, thread CPU clock), mean over ranks; stages by "
                        "function (bench/powersgd_step.py _stage_times)"}
    save("powersgd_profile" + (f"_{args.tag}" if args.tag else ""), settings, rows,
         ["model", "world", "rank", "stage", "cpu_ms_per_step"])


# The largest matrices of each model: vgg_fc's two hidden fully-connected layers, resnet18's last convolutions.
KERNEL_SHAPES = {"vgg_fc": ((1024, 2048), (1024, 1024)), "resnet18": ((512, 4608), (256, 2304))}


def _thread_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1000 * statistics.median(times)


def kernels(args: argparse.Namespace) -> None:
    """PowerSGD's two products with the thin factor on the right (as written) and on the left (as
    convoy computes them), one thread: CPU ms each, and whether the two give the same bits."""
    from convoy.compress.powersgd import times_thin   # here: --profile also runs on commits before it

    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        for rows_, cols in KERNEL_SHAPES[name]:
            for r in args.ranks:
                g = torch.Generator().manual_seed(0)
                m, q = torch.randn(rows_, cols, generator=g), torch.randn(cols, r, generator=g)
                p = torch.randn(rows_, r, generator=g)
                forms = {"P = M Q": (lambda: m @ q, lambda: times_thin(m, q)),
                         "Q_i = M^T P": (lambda: m.T @ p, lambda: times_thin(m.T, p))}
                for product, (right, left) in forms.items():
                    rows.append({"model": name, "matrix": f"{rows_} x {cols}", "rank": r, "product": product,
                                 "thin_right_ms": _thread_ms(right, args.rounds),
                                 "thin_left_ms": _thread_ms(left, args.rounds),
                                 "same_bits": bool(torch.equal(right(), left()))})
    save("powersgd_kernels", {**vars(args), "note": "median CPU ms of --rounds calls, one torch thread"}, rows,
         ["model", "matrix", "rank", "product", "thin_right_ms", "thin_left_ms", "same_bits"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg_fc", "resnet18"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per variant")
    parser.add_argument("--round-steps", type=int, default=3, help="steps per round")
    parser.add_argument("--batch", type=int, default=16, help="samples per worker")
    parser.add_argument("--hosts", type=int, default=None,
                        help="one rank on each of HOSTS emulated hosts (convoy bench cluster: root; hold "
                             "/tmp/convoy-netns.lock) instead of --world local processes on loopback")
    parser.add_argument("--rate", default="100mbit", help="with --hosts: each host's link, e.g. 100mbit, 1gbit")
    parser.add_argument("--tag", default="", help="results go to powersgd_step_TAG (with --hosts, default: "
                                                  "HOSTShosts_RATE)")
    parser.add_argument("--profile", action="store_true",
                        help="profile convoy's auxiliary thread instead (rounds x round-steps steps per R)")
    parser.add_argument("--blocking-rounds", action="store_true",
                        help="also run convoy with each bucket's P all-reduce blocking in start (convoy_blocking): "
                             "the engine's deferred rounds against the blocking ones, in the same run")
    parser.add_argument("--kernels", action="store_true",
                        help="time PowerSGD's products with the thin factor on either side instead (--rounds calls)")
    args = parser.parse_args()
    if args.hosts and (args.profile or args.kernels):
        parser.error("--hosts times the steps; --profile and --kernels run on loopback")
    if args.profile:
        profile(args)
        return
    if args.kernels:
        kernels(args)
        return
    if args.hosts:
        args.world = args.hosts   # the world the rows and settings record
    load_before = os.getloadavg()
    rows = []
    for name in args.models:
        channels = 3 if name == "resnet18" else 1
        job = (name, args.ranks, args.batch, args.round_steps, args.rounds, channels, args.blocking_rounds)
        # One rank per emulated host, or local processes on loopback: the same worker either way.
        results = run_on_hosts(worker, args.hosts, args.rate, *job) if args.hosts else spawn(worker, args.world, *job)
        rows += rows_for(name, args.world, args.ranks, results, args.rounds, args.blocking_rounds)
        for row in rows[-1 - len(_kinds(args.blocking_rounds)) * len(args.ranks):]:
            print(row, flush=True)
    settings = {**vars(args), "lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY,
                "hook_start_iter": HOOK_START_ITER, "load_before": list(load_before),
                "load_after": list(os.getloadavg()),
                "note": "medians over rounds; wall: the slowest rank's round / steps; cpu: process CPU seconds "
                        "(all threads) per step, mean over ranks; ratios: medians of per-round ratios"}
    tag = args.tag or (f"{args.hosts}hosts_{args.rate}" if args.hosts else "")
    save("powersgd_step" + (f"_{tag}" if tag else ""), settings, rows,
         ["model", "world", "variant", "rank", "buckets", "step_s", "cpu_s", "forward_wait_s", "wall/hook", "cpu/hook", "wall/floor",
          "cpu/floor"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

# The --tag of each --profile run, on the commit of each change, and what that change did.
POWERSGD_CHANGES = (("before", "before"), ("c1", "+ average in the gradient buffer"), ("c2", "+ residual in one pass"),
                    ("c3", "+ thin factor on the left"), ("c4", "+ parameters read in place"),
                    ("c5", "+ column scales on scalars"), ("c6", "+ P left in flight"),
                    # c6_again: the c6 commit re-measured in the same session as c7, interleaved (A/B).
                    ("c6_again", "c6 again, same session as c7"),
                    ("c7", "+ buffers reused, mean in Q"))


def render_powersgd_step() -> str:
    """convoy's powersgd against the hook at each R, before and after the changes; after: against the floor."""
    def by_key(name: str) -> dict[tuple, Row]:
        return {(r["model"], r["variant"], r["rank"]): r for r in rows_of(name)}

    before, after = by_key("powersgd_step_before"), by_key("powersgd_step_after")
    cells = []
    for (model, variant, rank), row in after.items():
        if variant != "convoy":
            continue
        old = before.get((model, variant, rank), {})
        blocking = after.get((model, "convoy_blocking", rank), {})
        cells.append([model, str(rank), str(row.get("buckets", "-")), seconds(after[(model, "floor", None)]["cpu_s"]),
                      seconds(after[(model, "hook", rank)]["cpu_s"]), seconds(row["cpu_s"]),
                      number(old.get("cpu/hook")), number(row["cpu/hook"]), number(old.get("wall/hook")),
                      number(row["wall/hook"]), number(blocking.get("wall/hook")), number(row["cpu/floor"]),
                      number(row["wall/floor"]), seconds(row["forward_wait_s"]),
                      seconds(blocking.get("forward_wait_s"))])
    return table(["model", "R", "convoy buckets", "floor CPU / step", "hook CPU / step", "convoy CPU / step", "convoy CPU / hook, before",
                  "after", "convoy wall / hook, before", "after", "after, P blocking", "convoy CPU / floor",
                  "convoy wall / floor", "forward waiting", "forward waiting, P blocking"], cells)


# The same-run step tables beside the loopback one above: emulated hosts at 100 Mbit (resnet18 again at the
# ranks its tuned peer came to, 8 and 16), and 4 ranks on loopback.
STEP_ON_HOSTS = ("powersgd_step_4hosts_100mbit", "powersgd_step_4hosts_100mbit_resnet18_r16",
                 "powersgd_step_2hosts_100mbit", "powersgd_step_world4", "powersgd_step_4hosts_100mbit_vgg_fc_avx512",
                 "powersgd_step_4hosts_100mbit_vgg_fc_epyc", "powersgd_step_4hosts_100mbit_resnet18_epyc",
                 "powersgd_step_world4_epyc", "powersgd_step_world4_resnet18_epyc",
                 "powersgd_step_world4_epyc_finite_from_payload",
                 "powersgd_step_4hosts_100mbit_resnet18_epyc_finite_from_payload", "powersgd_step_2hosts_100mbit_epyc",
                 "powersgd_step_world4_resnet18_epyc_r4_r8")


def _links(data: dict) -> str:
    """Where a file's rows ran: the links, and the CPU (its maker, family and vector unit) where the file records it."""
    settings, cpu = data["settings"], data.get("machine", {}).get("cpu")
    hosts = settings.get("hosts")
    links = f"{hosts} hosts, {settings['rate']}" if hosts else f"loopback, {settings['world']} ranks"
    return f"{links}, {cpu.replace('(R)', '').replace(' Processor', '')}" if cpu else links


def render_powersgd_step_hosts(*names: str) -> str:
    """Each file's convoy rows (every convoy variant) against its own run's hook at the same R and floor."""
    cells = []
    for data in loaded(*names):
        by = {(r["model"], r["variant"], r["rank"]): r for r in data["rows"]}
        for row in data["rows"]:
            if row["variant"] in ("floor", "hook"):
                continue
            model, rank = row["model"], row["rank"]
            hook, floor = by[(model, "hook", rank)], by[(model, "floor", None)]
            cells.append([_links(data), data.get("machine", {}).get("commit", "-"), model, str(rank), row["variant"],
                          str(row["buckets"]),
                          seconds(floor["step_s"]), seconds(hook["step_s"]), seconds(row["step_s"]),
                          number(row["wall/hook"]), number(row["cpu/hook"]), number(row["wall/floor"]),
                          seconds(row["forward_wait_s"])])
    return table(["links", "commit", "model", "R", "variant", "buckets", "floor step", "hook step", "convoy step",
                  "convoy wall / hook", "CPU / hook", "wall / floor", "forward waiting"], cells)


def render_powersgd_profile() -> str:
    """The auxiliary thread's CPU per stage, at each change (each file measured on its commit)."""
    stages = {tag: {(r["model"], r["rank"], r["stage"]): r["cpu_ms_per_step"] for r in rows_of(f"powersgd_profile_{tag}")}
              for tag, _ in POWERSGD_CHANGES}
    keys = [(r["model"], r["rank"], r["stage"]) for r in rows_of("powersgd_profile_before")]
    return table(["model", "R", "stage (CPU ms / step)", *(label for _, label in POWERSGD_CHANGES)],
                 [[model, str(rank), stage, *(f"{stages[tag][(model, rank, stage)]:.1f}"
                                              if (model, rank, stage) in stages[tag] else "-"
                                              for tag, _ in POWERSGD_CHANGES)]
                  for model, rank, stage in keys])


def render_powersgd_kernels() -> str:
    rows = rows_of("powersgd_kernels")
    return table(["model", "matrix", "R", "product", "thin factor right", "thin factor left", "faster", "same bits"],
                 [[r["model"], r["matrix"], str(r["rank"]), r["product"], f"{r['thin_right_ms']:.2f} ms",
                   f"{r['thin_left_ms']:.2f} ms", times(r["thin_right_ms"] / r["thin_left_ms"]),
                   "yes" if r["same_bits"] else "no"] for r in rows])


BLOCKS = (
    Block("powersgd_step", "convoy's PowerSGD step against DDP + torch's PowerSGD hook, loopback",
          ("powersgd_step_after", "powersgd_step_before"),
          "DDP + torch's powerSGD_hook at the same rank R (warm start, error feedback, one bucket) and the same "
          "ranks with no exchange (the floor), rounds interleaved in each run", render_powersgd_step,
          rerun="python bench/powersgd_step.py --blocking-rounds --tag after; --tag before on the commit before "
                "the changes"),
    Block("powersgd_step_hosts", "convoy's PowerSGD step against the hook on emulated hosts at 100 Mbit",
          STEP_ON_HOSTS, "DDP + torch's powerSGD_hook at the same rank R and the no-exchange floor, rounds "
          "interleaved in each run (one rank per emulated host, or local ranks on loopback; a CPU named "
          "where the file records it, the others on an earlier machine)",
          partial(render_powersgd_step_hosts, *STEP_ON_HOSTS),
          rerun="python bench/powersgd_step.py --hosts 4|2 --rate 100mbit --ranks 2 4; --world 4 --tag world4",
          emulated=True),
    Block("powersgd_profile", "Where convoy's PowerSGD step spends its auxiliary thread's CPU",
          tuple(f"powersgd_profile_{tag}" for tag, _ in POWERSGD_CHANGES), "the step before each change",
          render_powersgd_profile,
          rerun="python bench/powersgd_step.py --profile --ranks 4 --rounds 6 --tag TAG, each on its commit"),
    Block("powersgd_kernels", "PowerSGD's products with the thin factor on either side", ("powersgd_kernels",),
          "the products as written, thin factor on the right (what convoy ran before)", render_powersgd_kernels,
          rerun="python bench/powersgd_step.py --kernels --rounds 30"),
)


if __name__ == "__main__":
    main()
