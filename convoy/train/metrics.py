"""Run folders: one JSON-lines file of records per rank, read back by ``convoy plot``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"metrics-rank{rank}.jsonl"


class MetricsWriter:
    """Appends one JSON object per line; ``kind`` is ``"step"`` or ``"eval"``."""

    def __init__(self, run_dir: Path, rank: int):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(metrics_path(run_dir, rank), "w", buffering=1)

    def write(self, kind: str, **record: Any) -> None:
        self._file.write(json.dumps({"kind": kind, **record}) + "\n")

    def close(self) -> None:
        self._file.close()
