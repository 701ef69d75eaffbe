"""The default --block-size, chosen by measurement: selection cost and accuracy per block size.

    python -m bench.sparse_block_size [--sizes 0 16 32 64 256 1024] [--train-sizes 16 32 256]
                                      [--steps 300] [--parallel 2]

For every block size (0: rows and filters, cut along the first dimension) and the parameter shapes
of vgg_fc and resnet18 (3x32x32 inputs), times what blocktopk does per step
with one thread (block scores, choice of the top 1%, run-length encoding of a
random gradient), median of 3. For ``--train-sizes`` it also trains vgg_fc on
loopback as ``convoy train --model vgg_fc --nproc 2 --batch-size 16 --seed 5
--steps 300 --compress blocktopk --block-fraction 0.01 --block-size N`` (the
issue's acceptance command) and records the final test accuracy and the bytes
each worker sent, with a dense run as the peer.

Writes bench/results/sparse_block_size.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import save
from bench.figures import Block, percent, rows_of, seconds, table, times
from bench.compression.selection import _median_time, layer_shapes
from convoy.compress import BlockLayout
from convoy.compress.rle import encode

FRACTION = 0.01
TRAIN = ["--model", "vgg_fc", "--nproc", "2", "--batch-size", "16", "--seed", "5", "--no-progress"]


def selection_s(model: str, block_size: int) -> float:
    """Seconds per step blocktopk spends choosing and encoding 1% of every layer of ``model``."""
    layouts = [BlockLayout(shapes, block_size or None) for shapes in layer_shapes(model)]
    grads = [torch.randn(layout.numel) for layout in layouts]

    def select_and_encode() -> None:
        for layout, g in zip(layouts, grads):
            encode(g, layout, layout.select(layout.scores(g), fraction=FRACTION))

    return _median_time(select_and_encode, 3)


def train(extra: list[str], steps: int) -> dict:
    """Final test accuracy and MB sent per worker of one loopback run of vgg_fc."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "convoy", "train", *TRAIN, "--steps", str(steps), "--out", out, *extra]
        subprocess.run(command, check=True, capture_output=True, env=os.environ.copy())
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"test_accuracy": summary["test_accuracy"], "MB_sent": summary["bytes_sent_per_worker"] / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 16, 32, 64, 256, 1024])
    parser.add_argument("--train-sizes", type=int, nargs="*", default=[16, 32, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=2, help="training runs at once")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [{"block_size": size, **{f"{m}_select_s": selection_s(m, size) for m in ("vgg_fc", "resnet18")}}
            for size in args.sizes]
    runs = {"none": ["--compress", "none"]}
    runs.update({size: ["--compress", "blocktopk", "--block-fraction", str(FRACTION), "--block-size", str(size)]
                 for size in args.train_sizes})
    with ThreadPoolExecutor(args.parallel) as pool:
        results = dict(zip(runs, pool.map(lambda extra: train(extra, args.steps), runs.values())))
    dense = results.pop("none")
    for row in rows:
        if row["block_size"] in results:
            got = results[row["block_size"]]
            row.update(vgg_fc_accuracy=got["test_accuracy"], MB_sent=got["MB_sent"],
                       accuracy_vs_dense=got["test_accuracy"] - dense["test_accuracy"],
                       bytes_vs_dense=dense["MB_sent"] / got["MB_sent"])
    rows.append({"block_size": "dense", "vgg_fc_accuracy": dense["test_accuracy"], "MB_sent": dense["MB_sent"]})
    columns = ["block_size", "vgg_fc_select_s", "resnet18_select_s", "vgg_fc_accuracy", "accuracy_vs_dense",
               "MB_sent", "bytes_vs_dense"]
    save("sparse_block_size", {**vars(args), "fraction": FRACTION, "threads": 1,
                               "note": "shared 2-core machine; 0 = rows and filters"}, rows, columns)


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_sparse_block_size() -> str:
    rows = rows_of("sparse_block_size")
    return table(["block size (0: rows and filters)", "vgg_fc selection", "resnet18 selection",
                  "vgg_fc accuracy", "vs dense (points)", "fewer bytes than dense"],
                 [[str(r["block_size"]), seconds(r.get("vgg_fc_select_s")), seconds(r.get("resnet18_select_s")),
                   percent(r.get("vgg_fc_accuracy")),
                   "-" if r.get("accuracy_vs_dense") is None else f"{100 * r['accuracy_vs_dense']:+.1f}",
                   times(r.get("bytes_vs_dense"))] for r in rows])


BLOCKS = (
    Block("sparse_block_size", "blocktopk's block size", ("sparse_block_size",),
          "dense all-reduce (accuracy and bytes)", render_sparse_block_size,
          rerun="python -m bench.sparse_block_size"),
)


if __name__ == "__main__":
    main()
