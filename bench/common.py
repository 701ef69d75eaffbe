"""Shared plumbing of the benchmarks: spawning gloo workers, tables, result files."""
from __future__ import annotations

import json
import os
import pickle
import platform
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` gloo processes on loopback; their results."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, _free_port(), out, fn, args), nprocs=world,
                           start_method="spawn")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


def machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])


def save(name: str, settings: dict[str, Any], rows: list[dict[str, Any]], columns: Sequence[str]) -> Path:
    """Write results/<name>.json and results/<name>.md; print the table."""
    RESULTS.mkdir(exist_ok=True)
    text = table(rows, columns)
    print(text)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "settings": settings, "rows": rows}, indent=2))
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\nsettings: `{json.dumps(settings)}`\n\n{text}\n")
    return path
