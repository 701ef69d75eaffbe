"""What this machine's CPU spends besides forward and backward: compression and moving bytes.

These matter where ranks are short of cores (emulated hosts sharing a
machine): the auxiliary thread's work and the network stack's then come out
of the compute's time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from convoy.sim.codec import COMPRESSORS, Compression, numel_of


@dataclass(frozen=True)
class CpuCosts:
    """CPU nanoseconds per gradient element (compression) and per byte moved (exchanges).

    Args:
        compress: per compressor, ns per element to compress, error feedback included.
        decompress: ns per element to decode a payload into a dense tensor (an all-gather
            decodes one and adds the others' kept values into it).
        engine_ns_per_byte: CPU per byte a rank sends plus receives through convoy's
            engine (gloo's copies and reductions, the kernel's TCP, the auxiliary
            thread's Python work holding the GIL).
        peer_ns_per_byte: the same for torch DDP (its reducer is C++).
        compress_call_us, decompress_call_us: fixed microseconds per layer compressed
            and per payload decoded (Python, run-length coding headers, CRC), which
            dominate on small layers.
        powersgd_ns, powersgd_call_us: torch's PowerSGD hook, per gradient element
            and matrix rank, and per bucket (matrix products, orthogonalisation, error
            feedback; measured against plain DDP on one process: lenet +1.8 ms, vgg_fc
            +10 ms per step at rank 2).

    The defaults come from the 2-core machine of the README: compression by
    :func:`measure_cpu_costs` (one thread, a 1024 x 1024 gradient); bytes
    fitted to ``bench/results/engine_vs_ddp.json`` (loopback, 2 and 4 workers,
    where the network is free and only the CPU it costs shows).

    Example::

        >>> CpuCosts().seconds(Compression("topk", fraction=0.01), ((1024, 1024),), world=4)
        0.0156...
    """

    compress: dict[str, float] = field(default_factory=lambda: {
        "none": 0.0, "fp16": 3.0, "randomk": 14.4, "topk": 14.5, "blocktopk": 1.5})
    decompress: dict[str, float] = field(default_factory=lambda: {
        "none": 0.0, "fp16": 0.15, "randomk": 0.5, "topk": 0.35, "blocktopk": 0.35})
    engine_ns_per_byte: float = 1.1
    peer_ns_per_byte: float = 0.65
    compress_call_us: dict[str, float] = field(default_factory=lambda: {
        "none": 0.0, "fp16": 12.0, "randomk": 52.0, "topk": 55.0, "blocktopk": 430.0})
    decompress_call_us: dict[str, float] = field(default_factory=lambda: {
        "none": 0.0, "fp16": 3.0, "randomk": 5.0, "topk": 8.0, "blocktopk": 160.0})
    powersgd_ns: float = 1.5
    powersgd_call_us: float = 1500.0

    def seconds(self, compression: Compression, shapes: tuple[tuple[int, ...], ...], world: int) -> float:
        """Auxiliary-thread seconds to compress one layer of ``shapes`` and decode what comes back."""
        numel, name = sum(numel_of(s) for s in shapes), compression.name
        decodes = world if compression.payload(shapes)[0] == "allgather" else 1
        # One payload is decoded into a dense tensor; the other ranks' are added into it
        # where they carry values (Compressor.decompress_add): a call each, few elements.
        per_element = numel * 1e-9 * (self.compress[name] + self.decompress[name])
        return per_element + 1e-6 * (self.compress_call_us[name] + decodes * self.decompress_call_us[name])


def measure_cpu_costs(numel_side: int = 1024) -> CpuCosts:
    """:class:`CpuCosts` with compression measured here: every compressor (and its error
    feedback) on a ``side x side`` gradient for the cost per element and on a tiny conv
    layer for the cost per call, one thread; per-byte costs stay the defaults."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        big = _time_codecs(torch.randn(numel_side * numel_side), ((numel_side, numel_side),), repeats=3)
        small = _time_codecs(torch.randn(16 * 6 * 5 * 5 + 16), ((16, 6, 5, 5), (16,)), repeats=30)
    finally:
        torch.set_num_threads(threads)
    n = numel_side * numel_side
    return CpuCosts(compress={k: max(0.0, (big[k][0] - small[k][0]) / n * 1e9) for k in big},
                    decompress={k: max(0.0, (big[k][1] - small[k][1]) / n * 1e9) for k in big},
                    compress_call_us={k: small[k][0] * 1e6 for k in small},
                    decompress_call_us={k: small[k][1] * 1e6 for k in small})


def _time_codecs(grad, shapes: tuple, repeats: int) -> dict[str, tuple[float, float]]:
    """The fastest ``(compress + error feedback, one decode)`` seconds of every compressor."""
    from convoy.compress import LayerInfo, build_compressor

    info = LayerInfo(shapes=shapes)
    out = {"none": (0.0, 0.0)}
    for name in COMPRESSORS[1:]:
        compressor, memory = build_compressor(name, block_fraction=0.01 if name == "blocktopk" else None)
        both, decode = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compensated = memory.compensate(grad, "x")
            payload, ctx = compressor.compress(compensated, "x", info)
            memory.update(compensated, "x", compressor.decompress(payload, ctx))
            t1 = time.perf_counter()
            compressor.decompress(payload, ctx)
            t2 = time.perf_counter()
            both.append(t1 - t0)
            decode.append(t2 - t1)
        # Fastest of each (other jobs only add time); the error feedback decodes once
        # itself, and that decode is not the wire's.
        out[name] = (max(0.0, min(both) - min(decode)), min(decode))
    return out
