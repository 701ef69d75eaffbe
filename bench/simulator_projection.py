"""Project convoy's strategies to 8 ... 1024 nodes on 10 / 25 / 100 Gbit links, and check the
simulator against a published table (Horovod's 512-GPU scaling efficiency).

Models: ResNet-101 and VGG-16 at a P100's step time (shapes exact, compute
spread by FLOPs; see ``convoy.sim.zoo``), and resnet18 (CIFAR variant, batch
32) from the profile ``bench/simulator_validation.py`` measured on this CPU.
Scaling efficiency is samples per second on N nodes over N times one node's
(convoy's engine on one node: no network); ps and hybrid spend nodes on
servers or the head, which counts against them.
Writes bench/results/simulator_projection.{json,md,png}::

    python bench/simulator_projection.py
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, machine  # noqa: E402
from bench.figures import Block, load, percent, rows_of, seconds, table  # noqa: E402
from bench.simulator_validation import costs as measured_costs  # noqa: E402
from bench.simulator_validation import profile as measured_profile  # noqa: E402
from convoy.sim.cluster import Cluster  # noqa: E402
from convoy.sim.codec import Compression  # noqa: E402
from convoy.sim.cpu import CpuCosts  # noqa: E402
from convoy.sim.profile import ModelProfile  # noqa: E402
from convoy.sim.strategies import ClusterCycles, ConvFcSplit, LayerRing, ServerShards, Strategy, TorchDDP  # noqa: E402
from convoy.sim.table import format_table  # noqa: E402
from convoy.sim.zoo import from_shapes, resnet101_layers, vgg16_layers  # noqa: E402

NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
RATES_GBIT = (10, 25, 100)
LATENCY_S = 25e-6          # one message over TCP in a data centre
# A P100 at batch 64 (fp32, synthetic ImageNet), from TensorFlow's DGX-1 benchmarks: ResNet-50
# 219 img/s; ResNet-101 scaled by FLOPs (7.87 against 4.1 GMAC); VGG-16 "about the same speed"
# as ResNet-101 on cuDNN (jcjohnson/cnn-benchmarks), though it has twice the FLOPs.
P100_IMG_S = {"resnet101": 219 * 4.1 / 7.87, "vgg16": 219 * 4.1 / 7.87}
# Compression on a GPU: this CPU's ns/element divided by this (a P100's 730 GB/s of memory
# bandwidth against one core's ~10 GB/s, discounted for kernel launches). An assumption.
GPU_CODEC_SPEEDUP = 10
# NCCL runs a process group's collectives one after another on its stream (gloo: two at once).
GPU_LANES = 1


def gpu_costs(cpu: CpuCosts) -> CpuCosts:
    """This CPU's compression and PowerSGD costs, GPU_CODEC_SPEEDUP times faster."""
    def fast(costs: dict[str, float]) -> dict[str, float]:
        return {k: v / GPU_CODEC_SPEEDUP for k, v in costs.items()}

    return replace(cpu, compress=fast(cpu.compress), decompress=fast(cpu.decompress),
                   compress_call_us=fast(cpu.compress_call_us), decompress_call_us=fast(cpu.decompress_call_us),
                   powersgd_ns=cpu.powersgd_ns / GPU_CODEC_SPEEDUP,
                   powersgd_call_us=cpu.powersgd_call_us / GPU_CODEC_SPEEDUP)


def gpu_profiles() -> list[ModelProfile]:
    return [from_shapes(name, layers(), 64 / P100_IMG_S[name], 64,
                        f"P100 batch 64 at {P100_IMG_S[name]:.0f} img/s")
            for name, layers in (("resnet101", resnet101_layers), ("vgg16", vgg16_layers))]


def strategies(nodes: int, costs: CpuCosts, has_head: bool) -> list[Strategy]:
    out: list[Strategy] = [
        LayerRing(costs=costs), LayerRing(costs=costs, bucket_mb=25), TorchDDP(costs=costs),
        LayerRing(Compression("fp16"), costs), LayerRing(Compression("topk", 0.01), costs),
        LayerRing(Compression("blocktopk", block_fraction=0.01), costs),
        LayerRing(Compression("blocktopk", block_fraction=0.01, selection="global"), costs),
        TorchDDP(4, costs=costs), ClusterCycles(nodes // 8, 10, costs), ServerShards(nodes // 4, "graph", 1024, costs)]
    if has_head:
        out.append(ConvFcSplit(nodes - nodes // 8, nodes // 8, costs))
    return out


def project(profile: ModelProfile, costs: CpuCosts) -> list[dict]:
    rows = []
    # One node: convoy's engine without a network (updates hide, but layer 0's).
    single = profile.batch_size / LayerRing(costs=costs).step_time(profile, Cluster(1, 1e9)).step_s
    for gbit in RATES_GBIT:
        for nodes in NODES:
            cluster = Cluster(nodes, gbit * 1e9, latency_s=LATENCY_S, lanes=GPU_LANES)
            for strategy in strategies(nodes, costs, any(l.head for l in profile.layers)):
                b = strategy.step_time(profile, cluster)
                samples = strategy.workers(cluster) * profile.batch_size / b.step_s
                rows.append({"model": profile.name, "gbit": gbit, "nodes": nodes, "strategy": b.strategy.replace(
                    f"K={nodes // 8}", "K=N/8").replace(f"S={nodes // 4}", "S=N/4").replace(
                    f"{nodes - nodes // 8}+{nodes // 8}", "7N/8+N/8"), "step_s": b.step_s,
                    "efficiency": samples / (nodes * single), "sent_MB": b.sent_bytes / 1e6})
    return rows


def horovod_check(costs: CpuCosts) -> dict:
    """Horovod's docs: 128 servers x 4 Pascal GPUs, 25 Gbit RoCE, batch 64, 90% for ResNet-101, 68% VGG-16.

    A server's 4 GPUs share its NIC; NCCL's ring crosses each server once each
    way, so the network sees a 128-node ring whose every node computes a
    GPU's step. Horovod fuses tensors into 64 MB buffers, all-reduces them
    during backward and steps the optimizer after: DDP's pattern with 64 MB buckets.
    """
    out = {}
    for profile, published in zip(gpu_profiles(), (0.90, 0.68)):
        cluster = Cluster(128, 25e9, latency_s=5e-6)
        b = TorchDDP(bucket_mb=64, costs=costs).step_time(profile, cluster)
        # Horovod's efficiency is against one GPU without Horovod: forward, backward, update.
        out[profile.name] = {"published": published, "predicted": profile.compute_s / b.step_s,
                             "step_s": b.step_s, "compute_s": profile.compute_s, "source": profile.source}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), len(RATES_GBIT), figsize=(15, 4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, gbit in enumerate(RATES_GBIT):
            ax = axes[i][j]
            mine = [r for r in rows if r["model"] == model and r["gbit"] == gbit]
            for name in dict.fromkeys(r["strategy"] for r in mine):
                pts = [(r["nodes"], 100 * r["efficiency"]) for r in mine if r["strategy"] == name]
                ax.plot(*zip(*pts), marker="o", ms=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 105)
            ax.set_title(f"{model}, {gbit} Gbit/s")
            ax.set_xlabel("nodes")
            ax.set_ylabel("scaling efficiency %")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def tables(rows: list[dict]) -> str:
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for gbit in RATES_GBIT:
            mine = [r for r in rows if r["model"] == model and r["gbit"] == gbit]
            names = list(dict.fromkeys(r["strategy"] for r in mine))
            body = [[name] + [f"{r['step_s']:.3g} s ({100 * r['efficiency']:.0f}%)" for r in mine
                              if r["strategy"] == name] for name in names]
            parts.append(f"### {model}, {gbit} Gbit/s: step time (scaling efficiency)\n\n"
                         + format_table(["strategy", *map(str, NODES)], body, markdown=True))
    return "\n\n".join(parts)


def main() -> None:
    cpu = measured_costs()
    gpu = gpu_costs(cpu)
    rows = []
    for profile in gpu_profiles():
        rows += project(profile, gpu)
    rows += project(measured_profile("resnet18").at_batch(32), cpu)
    check = horovod_check(gpu)
    settings = {"nodes": NODES, "gbit": RATES_GBIT, "latency_s": LATENCY_S, "p100_img_s": P100_IMG_S,
                "gpu_codec_speedup": GPU_CODEC_SPEEDUP, "horovod_check": check}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "simulator_projection.json").write_text(
        json.dumps({"machine": machine(), "settings": settings, "rows": rows}, indent=1))
    text = tables(rows)
    lines = [f"| {m} | {c['published']:.0%} | {c['predicted']:.0%} | {c['step_s']:.3f} s |" for m, c in check.items()]
    horovod = "\n".join(["| model | Horovod, 512 GPUs, 25 Gbit | simulator | predicted step |",
                         "|---|---|---|---|", *lines])
    shown = {k: v for k, v in settings.items() if k != "horovod_check"}
    (RESULTS / "simulator_projection.md").write_text(
        f"# simulator_projection\n\nsettings: `{json.dumps(shown)}`\n\n## Published check\n\n{horovod}\n\n{text}\n")
    plot(rows, RESULTS / "simulator_projection.png")
    print(horovod)
    print(text)


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_simulator_projection() -> str:
    rows = rows_of("simulator_projection")
    settings = list(dict.fromkeys((r["model"], r["gbit"]) for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    eff = {(r["model"], r["gbit"], r["nodes"], r["strategy"]): r["efficiency"] for r in rows}
    parts = []
    for nodes in (64, 1024):
        parts.append(f"{nodes} nodes:\n\n" + table(
            ["strategy", *(f"{m} {g}G" for m, g in settings)],
            [[s, *(f"{100 * eff[(m, g, nodes, s)]:.0f}%" if (m, g, nodes, s) in eff else "-" for m, g in settings)]
             for s in strategies]))
    return "\n\n".join(parts)


def render_horovod_check() -> str:
    data = load("simulator_projection") or {"settings": {}}
    check = data["settings"].get("horovod_check", {})
    return table(["model", "Horovod (512 GPUs, 25 Gbit)", "simulator", "predicted step"],
                 [[m, percent(c.get("published")), percent(c.get("predicted")), seconds(c.get("step_s"))]
                  for m, c in check.items()])


BLOCKS = (
    Block("simulator_projection", "Projected scaling efficiency (a model, not a measurement)",
          ("simulator_projection",), "N x convoy's engine on one node", render_simulator_projection,
          rerun="python bench/simulator_projection.py"),
    Block("horovod_check", "The simulator against Horovod's published table", ("simulator_projection",),
          "Horovod's benchmark page (512 GPUs, 25 Gbit RoCE)", render_horovod_check,
          rerun="python bench/simulator_projection.py"),
)


if __name__ == "__main__":
    main()
