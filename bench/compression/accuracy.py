"""Benchmark 3: test accuracy after a fixed number of steps on digits, N workers, per compressor.

    python -m bench.compression.accuracy [--world 4] [--steps 880] [--model lenet]

Every convoy row is ``convoy train`` (convoy.train.loop.run) with the given
compressor and otherwise default settings (SGD lr 0.05, momentum 0.9, weight
decay 5e-4, cosine schedule, batch 16 per worker); the peer is torch DDP with
torch's PowerSGD communication hook (rank 1, vanilla all-reduce for the first
``--powersgd-start`` steps), same model, data order and optimizer. Bytes are
what each worker sends per step (PowerSGD's: its all-reduces counted as ring
all-reduces). Writes bench/results/compression_accuracy.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from bench.common import RESULTS, save, spawn
from bench.figures import Block, number, rows_of, table, times
from bench.compression.plot import bars
from bench.peers.ddp_train import train_ddp
from convoy.train.config import TrainConfig
from convoy.train.loop import run

# (label, TrainConfig.from_flat settings)
RUNS: list[tuple[str, dict[str, Any]]] = [
    ("none", {"compress": "none"}),
    ("fp16", {"compress": "fp16"}),
    ("topk 1%", {"compress": "topk", "element_fraction": 0.01}),
    ("blocktopk k=1", {"compress": "blocktopk", "blocks_per_layer": 1}),
    ("blocktopk 1%", {"compress": "blocktopk", "block_fraction": 0.01}),
    ("blocktopk 1% global", {"compress": "blocktopk", "block_fraction": 0.01, "block_selection": "global"}),
    ("blocktopk 10%", {"compress": "blocktopk", "block_fraction": 0.1}),
    ("topk 1% warm-up 100", {"compress": "topk", "element_fraction": 0.01, "warmup_steps": 100}),
    ("blocktopk k=1 warm-up 100", {"compress": "blocktopk", "blocks_per_layer": 1, "warmup_steps": 100}),
    ("blocktopk 1% global warm-up 100", {"compress": "blocktopk", "block_fraction": 0.01,
                                         "block_selection": "global", "warmup_steps": 100}),
    ("blocktopk 10% warm-up 100", {"compress": "blocktopk", "block_fraction": 0.1, "warmup_steps": 100}),
]
PEER = "DDP + PowerSGD rank 1"


def _earlier_rows(settings: dict[str, Any], rerun: list[str]) -> list[dict]:
    """Rows of the last saved run with the same settings, except those being run again."""
    path = RESULTS / "compression_accuracy.json"
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    same = {k: v for k, v in saved["settings"].items() if k != "only"} == \
        {k: v for k, v in settings.items() if k != "only"}
    return [r for r in saved["rows"] if r["method"] not in rerun] if same else []


def convoy_worker(rank: int, world: int, fields: dict[str, Any]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        summary = run(TrainConfig.from_flat(**fields, out=out, progress=False, nproc=world).validate())
    return {"test_accuracy": summary.test_accuracy, "wall_s": summary.wall_s,
            "bytes_per_step": summary.bytes_sent_per_worker / summary.steps}


def powersgd_worker(rank: int, world: int, fields: dict[str, Any], start_iter: int) -> dict:
    config = TrainConfig.from_flat(**fields, nproc=world).validate()
    return train_ddp(rank, world, steps=config.run.steps, model=config.model.name, dataset=config.data.dataset,
                     batch_size=config.data.batch_size, lr=config.optim.lr, momentum=config.optim.momentum,
                     weight_decay=config.optim.weight_decay, lr_schedule=config.optim.lr_schedule, seed=config.run.seed,
                     powersgd_rank=1, powersgd_start=start_iter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=880)
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--batch", type=int, default=16, help="samples per worker")
    parser.add_argument("--powersgd-start", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="labels of the rows to run again; the other rows are "
                        "kept from the last saved run with the same settings (default: run all)")
    args = parser.parse_args()
    base = {"model": args.model, "steps": args.steps, "batch_size": args.batch}
    settings = {**vars(args), "dataset": "digits", "note": "shared 2-core machine, loopback gloo"}
    order = [label for label, _ in RUNS] + [PEER]
    rows = _earlier_rows(settings, args.only) if args.only else []
    for label, fields in RUNS + [(PEER, None)]:
        if args.only and label not in args.only:
            continue
        if fields is None:
            result = spawn(powersgd_worker, args.world, base, args.powersgd_start)[0]
        else:
            result = spawn(convoy_worker, args.world, {**base, **fields})[0]
        rows.append({"method": label, "test_accuracy_%": 100 * result["test_accuracy"],
                     "kB_sent/step": result["bytes_per_step"] / 1e3, "wall_s": result["wall_s"]})
        print(rows[-1], flush=True)
    rows.sort(key=lambda r: order.index(r["method"]) if r["method"] in order else len(order))
    dense = next((r["kB_sent/step"] for r in rows if r["method"] == "none"), None)
    for row in rows:
        row["ratio"] = dense / row["kB_sent/step"] if dense else None
        row["vs dense (points)"] = (row["test_accuracy_%"] - rows[0]["test_accuracy_%"]
                                    if rows[0]["method"] == "none" else None)
    save("compression_accuracy", settings, rows,
         ["method", "test_accuracy_%", "vs dense (points)", "kB_sent/step", "ratio", "wall_s"])
    bars("compression_accuracy", rows, "method", ["test_accuracy_%"], "test accuracy (%)",
         f"digits, {args.model}, N={args.world}, {args.steps} steps")


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_compression_accuracy() -> str:
    rows = rows_of("compression_accuracy")
    return table(["method", "test accuracy", "vs dense (points)", "kB sent / step", "fewer bytes than dense"],
                 [[r["method"], f"{r['test_accuracy_%']:.2f}%", f"{r['vs dense (points)']:+.1f}",
                   number(r["kB_sent/step"]), times(r["ratio"])] for r in rows])


BLOCKS = (
    Block("compression_accuracy", "Accuracy of the compressors, lenet, 4 workers", ("compression_accuracy",),
          "torch DDP with torch's PowerSGD hook", render_compression_accuracy,
          rerun="python -m bench.compression.accuracy"),
)


if __name__ == "__main__":
    main()
