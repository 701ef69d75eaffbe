"""Benchmark 2: bytes each worker sends per step with every compressor, all headers and indices counted.

    python -m bench.compression.wire_bytes [--models vgg_fc resnet18] [--worlds 2 4] [--steps 3]

Real engine, real gloo exchanges on loopback; the bytes are what the sync
strategy puts on the wire (padding, size exchanges, run headers, checksums,
indices, the global variant's score all-reduce). ``ratio`` is dense bytes over
compressed bytes. Writes bench/results/compression_wire_bytes.{json,md,png}.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import save, spawn
from bench.figures import Block, rows_of, table
from bench.compression.plot import bars
from convoy.compress import build_compressor
from convoy.engine import Engine
from convoy.models import build_model
from convoy.sync import AllReduce

# (label, compressor name, build_compressor options)
COMPRESSORS = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("randomk 1%", "randomk", {"element_fraction": 0.01}),
    ("topk 1%", "topk", {"element_fraction": 0.01}),
    ("blocktopk k=1", "blocktopk", {"blocks_per_layer": 1}),
    ("blocktopk 1%", "blocktopk", {"block_fraction": 0.01}),
    ("blocktopk 1% global", "blocktopk", {"block_fraction": 0.01, "block_selection": "global"}),
]


def worker(rank: int, world: int, model_name: str, channels: int, batch: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, channels, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    sent = {}
    for label, name, options in COMPRESSORS:
        torch.manual_seed(0)
        model = build_model(model_name, in_channels=channels, num_classes=10)
        strategy = AllReduce(dist.new_group(), *build_compressor(name, **options))
        engine = Engine(model, torch.optim.SGD, strategy, lr=0.01, momentum=0.9)
        for _ in range(steps):
            engine.backward(F.cross_entropy(model(x), y))
        engine.close()
        sent[label] = strategy.bytes_sent / steps
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vgg_fc", "resnet18"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples per worker")
    args = parser.parse_args()
    rows = []
    for model_name in args.models:
        channels = 3 if model_name == "resnet18" else 1
        for world in args.worlds:
            sent = spawn(worker, world, model_name, channels, args.batch, args.steps)[0]
            dense = sent["none"]
            for label, _, _ in COMPRESSORS:
                rows.append({"model": model_name, "world": world, "compressor": label,
                             "kB_sent/step": sent[label] / 1e3, "ratio": dense / sent[label]})
                print(rows[-1], flush=True)
    save("compression_wire_bytes", {**vars(args), "note": "shared 2-core machine, loopback gloo"}, rows,
         ["model", "world", "compressor", "kB_sent/step", "ratio"])
    for row in rows:
        row["setting"] = f"{row['model']} N={row['world']}"
        row[row["compressor"]] = row["ratio"]
    bars("compression_wire_bytes", rows, "setting", [label for label, _, _ in COMPRESSORS],
         "dense bytes / compressed bytes", "Compression ratio on the wire (per worker, per step)", log=True)


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_compression_wire_bytes() -> str:
    rows = rows_of("compression_wire_bytes")
    compressors = list(dict.fromkeys(r["compressor"] for r in rows))
    settings = list(dict.fromkeys((r["model"], r["world"]) for r in rows))
    cell = {(r["model"], r["world"], r["compressor"]): r for r in rows}

    def show(model: str, world: int, name: str) -> str:
        r = cell.get((model, world, name))
        if r is None:
            return "-"
        return f"{r['kB_sent/step'] / 1000:.3g} MB" if r["ratio"] == 1 else f"{r['ratio']:.0f}x"
    return table(["model, workers", *compressors],
                 [[f"{m}, {w}", *(show(m, w, c) for c in compressors)] for m, w in settings])


BLOCKS = (
    Block("compression_wire_bytes", "Bytes each worker sends per step", ("compression_wire_bytes",),
          "dense fp32 all-reduce (first column; the others are how many times fewer bytes)",
          render_compression_wire_bytes, rerun="python -m bench.compression.wire_bytes"),
)


if __name__ == "__main__":
    main()
