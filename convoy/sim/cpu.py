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
        compress: per compressor, ns per element to compress, error feedback and the
            wire row's packing included.
        decompress: ns per element to decode a payload into a dense tensor and average
            it (an all-gather decodes one and adds the others' kept values into it).
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

    The defaults were measured on a 2-core CPU machine: compression by
    :func:`measure_cpu_costs` (one thread, a 2048 x 1024 gradient); bytes
    fitted to ``bench/results/engine_vs_ddp.json`` (loopback, 2 and 4 workers,
    where the network is free and only the CPU it costs shows). powersgd's were
    measured later, on a busier machine, and scaled by fp16's ratio to its default
    (rank 2: two matrix products, Gram-Schmidt, P Q^T).

    Example::

        >>> CpuCosts().seconds(Compression("topk", fraction=0.01), ((1024, 1024),), world=4)
        0.0269...
    """

    compress: dict[str, float] = field(default_factory=lambda: {
        "none": 0.0, "fp16": 2.9, "randomk": 24.5, "topk": 24.5, "blocktopk": 2.95, "powersgd": 2.2})
    decompress: dict[str, float] = field(default_factory=lambda: {
        "none": 0.3, "fp16": 0.77, "randomk": 0.67, "topk": 0.83, "blocktopk": 0.73, "powersgd": 1.3})
    engine_ns_per_byte: float = 1.1
    peer_ns_per_byte: float = 0.65
    compress_call_us: dict[str, float] = field(default_factory=lambda: {
        "none": 1.1, "fp16": 27.0, "randomk": 108.0, "topk": 114.0, "blocktopk": 735.0, "powersgd": 160.0})
    decompress_call_us: dict[str, float] = field(default_factory=lambda: {
        "none": 8.6, "fp16": 16.0, "randomk": 27.0, "topk": 62.0, "blocktopk": 343.0, "powersgd": 66.0})
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


def measure_cpu_costs(big_shape: tuple[int, int] = (2048, 1024)) -> CpuCosts:
    """:class:`CpuCosts` with compression measured here, one thread, the way
    :class:`convoy.sync.AllReduce` runs it: error feedback, compression, the wire row,
    and on the way back decoding and averaging. The cost per element comes from a
    ``big_shape`` gradient (8 MB by default: large layers' tensors outgrow the caches
    and every pass allocates, which a cached 4 MB tensor hides), the cost per call
    from a tiny conv layer; per-byte costs stay the defaults."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = numel_of(big_shape)
        big = _time_codecs(torch.randn(n), (big_shape,), repeats=7)
        small = _time_codecs(torch.randn(16 * 6 * 5 * 5 + 16), ((16, 6, 5, 5), (16,)), repeats=31)
    finally:
        torch.set_num_threads(threads)
    return CpuCosts(compress={k: max(0.0, (big[k][0] - small[k][0]) / n * 1e9) for k in big},
                    decompress={k: max(0.0, (big[k][1] - small[k][1]) / n * 1e9) for k in big},
                    compress_call_us={k: small[k][0] * 1e6 for k in small},
                    decompress_call_us={k: small[k][1] * 1e6 for k in small})


def _time_codecs(grad, shapes: tuple, repeats: int) -> dict[str, tuple[float, float]]:
    """The median ``(send side, one decode)`` seconds of every compressor on ``grad``.

    The send side is the error feedback, compression and packing of the wire row; one
    decode is unpacking a row and decompressing it, plus the averaging division (a dense
    or summed payload's whole decode, which :meth:`CpuCosts.seconds` counts once)."""
    import statistics

    from convoy.compress import LayerInfo, build_compressor
    from convoy.sync.rows import pack_row, row_extent, unpack_row

    info = LayerInfo(shapes=shapes)
    out = {}
    for name in COMPRESSORS:
        compressor, memory = build_compressor(name, block_fraction=0.01 if name == "blocktopk" else None)
        send, decode = [], []
        for _ in range(repeats):
            fresh = grad.clone()   # the dense path averages the gradient in place
            t0 = time.perf_counter()
            compensated = memory.compensate(fresh, "x")
            payload, ctx = compressor.compress(compensated, "x", info)
            while compressor.more_rounds(ctx):   # a world of one: the sum is the payload
                payload, ctx = compressor.next_round(payload, ctx)
            memory.keep_unsent(compensated, "x", compressor, payload, ctx)
            row = None if compressor.summable else pack_row(payload, row_extent(payload)[1])
            t1 = time.perf_counter()
            received = payload if row is None else unpack_row(row, [t.dtype for t in payload])
            compressor.decompress(received, ctx).div_(4)
            send.append(t1 - t0)
            decode.append(time.perf_counter() - t1)
        out[name] = (statistics.median(send), statistics.median(decode))
    return out
