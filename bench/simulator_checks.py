"""Two of the simulator's assumptions, measured on this machine.

* **Lanes:** gloo runs two collectives of a process group at once. Each of 4
  local processes starts an all-reduce of 128 MB and then one of 1000 floats;
  if the small one ended long before the large one, they ran side by side.
* **The auxiliary thread's CPU:** ``convoy train --nproc 4 --model vgg_fc``
  on loopback, once per compressor; each thread's CPU time (``/proc/<pid>/task``)
  over a window of the run, per step, next to what ``convoy.sim.cpu.CpuCosts``
  (the stored ``bench/results/simulator_cpu_costs.json``) and the profile's
  updates give the auxiliary thread.

Writes bench/results/simulator_checks.{json,md}::

    python bench/simulator_checks.py [--steps 300] [--window-s 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.figures import Block, rows_of, seconds, table  # noqa: E402

COMPRESSORS = {"none": [], "fp16": ["--compress", "fp16"], "topk": ["--compress", "topk"],
               "randomk": ["--compress", "randomk"], "blocktopk k=1": ["--compress", "blocktopk"],
               "blocktopk 0.01": ["--compress", "blocktopk", "--block-fraction", "0.01"]}


def _lanes_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    big, small = torch.randn(32 * 1024 * 1024), torch.randn(1000)
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(big, async_op=True), dist.all_reduce(small, async_op=True)]
        works[1].wait()
        small_s = time.perf_counter() - start
        works[0].wait()
        times.append((small_s, time.perf_counter() - start))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def lanes() -> list[dict]:
    import torch.multiprocessing as mp

    from convoy.utils.spawn import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "lanes.json")
        mp.spawn(_lanes_worker, args=(4, free_port(), out), nprocs=4)
        return [{"check": "lanes", "small_done_s": s, "large_done_s": b} for s, b in json.loads(Path(out).read_text())]


def _cpu_seconds(root: int) -> dict[tuple[int, int], tuple[str, float]]:
    """``(name, CPU seconds so far)`` of every thread of ``root``'s descendants, by (pid, tid)."""
    tick = os.sysconf("SC_CLK_TCK")
    out, pids = {}, _descendants(root)
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            out[(pid, int(task.name))] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


def auxiliary_cpu(name: str, flags: list[str], steps: int, window_s: float) -> dict:
    """Per step and worker: the CPU of the main thread, the auxiliary thread and gloo's threads; the step."""
    with tempfile.TemporaryDirectory() as out:
        job = subprocess.Popen(["convoy", "train", "--nproc", "4", "--model", "vgg_fc", "--batch-size", "16",
                                "--steps", str(steps), "--lr-schedule", "constant", "--no-progress",
                                "--warmup-steps", "0", "--out", out, *flags],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(window_s * 0.8)   # past start-up and the first steps
        before, start = _cpu_seconds(job.pid), time.monotonic()
        time.sleep(window_s)
        after, seconds = _cpu_seconds(job.pid), time.monotonic() - start
        if job.wait() != 0:
            raise RuntimeError(f"convoy train with {flags} failed")
        records = [json.loads(line) for line in (Path(out) / "metrics-rank0.jsonl").read_text().splitlines()]
    step_s = statistics.mean(r["wall_s"] for r in records if r.get("kind") == "step" and r["step"] >= 20)
    ms = {"main": 0.0, "auxiliary": 0.0, "gloo": 0.0}   # per step and worker
    for key, (thread, cpu) in after.items():
        if key in before:
            role = "main" if key[0] == key[1] else "gloo" if "gloo" in thread else "auxiliary"
            ms[role] += 1e3 * (cpu - before[key][1]) / seconds * step_s / 4
    return {"check": "auxiliary_cpu", "compressor": name, "step_s": step_s, **{f"{k}_cpu_ms": v for k, v in ms.items()},
            "modelled_aux_ms": 1e3 * modelled_aux_s(name)}


def modelled_aux_s(name: str) -> float:
    """The auxiliary thread's CPU per step that the simulator charges vgg_fc at batch 16 on 4 ranks."""
    from convoy.sim.codec import Compression
    from convoy.sim.cpu import CpuCosts
    from convoy.sim.profile import load_profile

    costs = CpuCosts(**json.loads((RESULTS / "simulator_cpu_costs.json").read_text()))
    profile = load_profile(RESULTS / "simulator_profile_vgg_fc.json").at_batch(16)
    kind, _, knob = name.partition(" ")
    compression = Compression(kind, block_fraction=float(knob) if knob and "=" not in knob else None)
    return sum(costs.seconds(compression, l.shapes, 4) + l.update_s for l in profile.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each training run (default: 300)")
    parser.add_argument("--window-s", type=float, default=30, help="seconds of each run sampled (default: 30)")
    args = parser.parse_args()
    rows = lanes() + [auxiliary_cpu(name, flags, args.steps, args.window_s) for name, flags in COMPRESSORS.items()]
    save("simulator_checks", {"steps": args.steps, "window_s": args.window_s, "model": "vgg_fc", "batch_size": 16,
                              "processes": 4}, rows,
         ["check", "small_done_s", "large_done_s", "compressor", "step_s", "main_cpu_ms", "auxiliary_cpu_ms",
          "gloo_cpu_ms", "modelled_aux_ms"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_simulator_checks() -> str:
    rows = rows_of("simulator_checks")
    return table(["check", "small collective done after", "large collective done after"],
                 [[r["check"], seconds(r["small_done_s"]), seconds(r["large_done_s"])]
                  for r in rows if r["check"] == "lanes"])


BLOCKS = (
    Block("simulator_checks", "gloo runs two collectives at once", ("simulator_checks",),
          "a small all-reduce started after a large one", render_simulator_checks,
          rerun="python bench/simulator_checks.py"),
)


if __name__ == "__main__":
    main()
