"""Benchmark 1: cost of choosing what to send, per step, over every layer of a model, one thread.

    python -m bench.compression.selection [--fraction 0.01] [--repeats 3] [--models resnet18 vgg16]

For each model's parameter shapes (resnet18: convoy's CIFAR ResNet-18; vgg16:
the ImageNet VGG-16 of Simonyan & Zisserman, 138 M parameters) and a random
gradient, times per step (median of ``repeats``):

* ``blocktopk_s``: block scores (L1) + choice of the top blocks of every parameter;
* ``blocktopk_l2_s``: the same with L2 scores;
* ``blocktopk_encode_s``: the same plus run-length encoding (what the compressor does);
* ``topk_s``: element-wise ``abs().topk(k)`` per layer at the same density;
* ``sum_s``: ``torch.sum`` over each gradient, one read pass.

Writes bench/results/compression_selection.{json,md,png}.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from bench.common import save
from bench.figures import Block, rows_of, seconds, table, times
from bench.compression.plot import bars
from convoy.compress import BlockLayout
from convoy.compress.rle import encode
from convoy.models import build_model

_VGG16_CONV = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)


def vgg16_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of ImageNet VGG-16 (weight then bias per layer): 138.4 M values."""
    shapes, width = [], 3
    for out in _VGG16_CONV:
        shapes += [(out, width, 3, 3), (out,)]
        width = out
    for out, inp in ((4096, 512 * 7 * 7), (4096, 4096), (1000, 4096)):
        shapes += [(out, inp), (out,)]
    return shapes


def layer_shapes(name: str) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of each layer (a weight and its bias are one layer, as in the engine)."""
    if name == "vgg16":
        flat = vgg16_shapes()
        return [flat[i:i + 2] for i in range(0, len(flat), 2)]
    model = build_model(name, in_channels=3, num_classes=10)
    return [[tuple(p.shape) for p in module.parameters(recurse=False)]
            for module in model.modules() if any(True for _ in module.parameters(recurse=False))]


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, fraction: float, repeats: int) -> dict:
    layers = [BlockLayout(shapes) for shapes in layer_shapes(name)]
    grads = [torch.randn(layout.numel) for layout in layers]
    kept = [sum(len(i) * s.block_size for i, s in zip(layout.select(layout.scores(g), fraction=fraction),
                                                       layout.segments))
            for layout, g in zip(layers, grads)]

    def blocktopk(metric: str = "l1") -> None:
        for layout, g in zip(layers, grads):
            layout.select(layout.scores(g, metric), fraction=fraction)

    def blocktopk_encode() -> None:
        for layout, g in zip(layers, grads):
            encode(g, layout, layout.select(layout.scores(g, "l1"), fraction=fraction))

    def topk() -> None:
        # The same number of elements blocktopk keeps in each layer.
        for g, k in zip(grads, kept):
            g.abs().topk(max(1, k), sorted=False)

    def read_pass() -> None:
        for g in grads:
            torch.sum(g)

    row = {"model": name, "values_M": sum(g.numel() for g in grads) / 1e6, "fraction": fraction,
           "kept_share": sum(kept) / sum(g.numel() for g in grads)}
    for label, fn in (("blocktopk_s", blocktopk), ("blocktopk_l2_s", lambda: blocktopk("l2")),
                      ("blocktopk_encode_s", blocktopk_encode),
                      ("topk_s", topk), ("sum_s", read_pass)):
        row[label] = _median_time(fn, repeats)
        print(f"{name} {label}: {row[label]:.4f} s", flush=True)
    row["topk/blocktopk"] = row["topk_s"] / row["blocktopk_s"]
    row["blocktopk/sum"] = row["blocktopk_s"] / row["sum_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "vgg16"])
    parser.add_argument("--fraction", type=float, default=0.01, help="share of blocks (and elements) kept")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [measure(name, args.fraction, args.repeats) for name in args.models]
    columns = ["model", "values_M", "kept_share", "blocktopk_s", "blocktopk_l2_s", "blocktopk_encode_s", "topk_s", "sum_s",
               "topk/blocktopk", "blocktopk/sum"]
    save("compression_selection", {**vars(args), "threads": 1, "note": "shared 2-core machine"}, rows, columns)
    bars("compression_selection", rows, "model", ["blocktopk_s", "blocktopk_encode_s", "topk_s", "sum_s"],
         "seconds per step (one thread)", "Selection cost per step, all layers", log=True)


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_compression_selection() -> str:
    rows = rows_of("compression_selection")
    return table(["shapes", "values", "blocktopk L1", "blocktopk L2", "+ run-length coding", "torch.topk",
                  "torch.sum (one read)", "topk / blocktopk", "blocktopk / sum"],
                 [[r["model"], f"{r['values_M']:.3g} M", seconds(r["blocktopk_s"]), seconds(r["blocktopk_l2_s"]),
                   seconds(r["blocktopk_encode_s"]), seconds(r["topk_s"]), seconds(r["sum_s"]),
                   times(r["topk/blocktopk"]), times(r["blocktopk/sum"])] for r in rows])


BLOCKS = (
    Block("compression_selection", "Block selection against torch.topk", ("compression_selection",),
          "torch.topk at the same number of elements", render_compression_selection,
          rerun="python -m bench.compression.selection"),
)


if __name__ == "__main__":
    main()
