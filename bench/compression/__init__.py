"""Benchmarks of gradient compression (issue 3): selection cost, bytes on the wire, accuracy.

    python -m bench.compression.selection
    python -m bench.compression.wire_bytes
    python -m bench.compression.accuracy
"""
