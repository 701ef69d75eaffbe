"""Run folders: one JSON-lines file of records per rank, read back by ``convoy plot``.

Rank 0 can also write the same records to a TensorBoard events file and a CSV
file (``--logger tensorboard``, ``--logger csv``). Only rank 0 does, so a run
folder holds one of each: in data parallelism every rank's loss and bytes are
alike, and the JSONL files keep every rank's records for the rest.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

# The columns of metrics.csv that come first; a step's other figures follow.
CSV_LEADING = ("kind", "step", "epoch", "time", "loss", "train_accuracy", "test_accuracy", "test_loss")


def metrics_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"metrics-rank{rank}.jsonl"


class CsvLogger:
    """``metrics.csv``: one row per record; the header is fixed by the first step record.

    Evaluation records written before the first step record wait for it.
    """

    def __init__(self, run_dir: Path):
        self._file = open(run_dir / "metrics.csv", "w", newline="", buffering=1)
        self._writer: csv.DictWriter | None = None
        self._waiting: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None and record["kind"] != "step":
            self._waiting.append(record)
            return
        if self._writer is None:
            columns = list(CSV_LEADING) + [k for k in record if k not in CSV_LEADING]
            self._writer = csv.DictWriter(self._file, columns, extrasaction="ignore")
            self._writer.writeheader()
        for waiting in self._waiting:
            self._writer.writerow(waiting)
        self._waiting.clear()
        self._writer.writerow(record)

    def close(self) -> None:
        if self._writer is None and self._waiting:   # a run without a step record
            self._writer = csv.DictWriter(self._file, list(CSV_LEADING), extrasaction="ignore")
            self._writer.writeheader()
            self._writer.writerows(self._waiting)
        self._file.close()


class TensorBoardLogger:
    """An events file: every number of a record as the scalar ``<kind>/<name>`` at its step.

    Step records hold the loss, train accuracy, bytes sent and received and the
    step's time (``step/wall_s``); evaluation records the test accuracy and loss.
    """

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter   # slow to import: only when asked for

        self._writer = SummaryWriter(log_dir=str(run_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{record['kind']}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


_LOGGERS = {"csv": CsvLogger, "tensorboard": TensorBoardLogger}


class MetricsWriter:
    """Appends one JSON object per line; ``kind`` is ``"step"`` or ``"eval"``.

    Args:
        run_dir: the run folder.
        rank: this process's rank (names the JSONL file).
        loggers: further formats rank 0 writes: ``"csv"``, ``"tensorboard"``.

    Example::

        >>> metrics = MetricsWriter(Path("runs/a"), rank=0, loggers=("csv",))
        >>> metrics.write("eval", step=10, test_accuracy=0.9)
        >>> metrics.close()
    """

    def __init__(self, run_dir: Path, rank: int, loggers: tuple[str, ...] = ()):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(metrics_path(run_dir, rank), "w", buffering=1)
        self._loggers = [_LOGGERS[name](run_dir) for name in loggers] if rank == 0 else []

    def write(self, kind: str, **record: Any) -> None:
        line = {"kind": kind, **record}
        self._file.write(json.dumps(line) + "\n")
        for logger in self._loggers:
            logger.write(line)

    def close(self) -> None:
        self._file.close()
        for logger in self._loggers:
            logger.close()
