"""A readable description of a checkpoint directory: files, both areas, validity, file system.

Example::

    >>> print(describe_directory("ckpt"))
    ckpt: ext4 at / (no DAX: pwrite + fdatasync)
    written by 2 workers, global batch 32
    model-rank0.ckpt  model, 5 layers, 2 x 0.49 MB = 1.0 MB
      area A: step 12 (epoch 0, batch 12), generation 12, valid
      area B: step 11 (epoch 0, batch 11), generation 11, valid
"""
from __future__ import annotations

from pathlib import Path

from convoy.checkpoint.format import FormatError
from convoy.checkpoint.fsinfo import fs_info
from convoy.checkpoint.difflog import log_path, read_chain
from convoy.checkpoint.recovery import restore_points, scan, valid_steps
from convoy.checkpoint.written import recorded_job
from convoy.checkpoint.store import AREAS, Store
from convoy.errors import UsageError


def describe_directory(directory: str | Path) -> str:
    """Every checkpoint file in ``directory`` with both areas checked (records and checksums).

    Raises:
        UsageError: the directory does not exist or holds no checkpoint file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"checkpoint directory {directory} does not exist")
    files = sorted(directory.glob("model-rank*.ckpt")) + sorted(directory.glob("state-rank*.ckpt"))
    if not files:
        raise UsageError(f"{directory} holds no convoy checkpoint files")
    lines = [f"{directory}: {fs_info(directory).describe()}"]
    job = recorded_job(directory)
    if job is not None:
        batch = f", global batch {job.global_batch}" if job.global_batch else ""
        lines.append(f"written by {job.world} worker{'s' if job.world != 1 else ''}{batch}")
    for path in files:
        lines += _describe_file(path)
    return "\n".join(lines)


def recoverable_step(directory: str | Path) -> int | None:
    """The newest step valid in every checkpoint file of ``directory``; None when there is none.

    A resume needs the model files and every rank's own file at one step, so
    a step missing from any file is not recoverable. A model file restores its
    areas' steps and the steps its differential logs reach; a rank file serves
    a step of a log when it holds the log's snapshot (a resume replays the
    steps between, where the job allows it: ``session.replay_ok``).

    Example::

        >>> recoverable_step("ckpt")   # doctest: +SKIP
        12
    """
    if not any(Path(directory).glob("model-rank*.ckpt")):
        return None
    bases: dict[int, int] = {}   # a model file's step -> the full snapshot its log extends
    rank_steps: list[set[int]] = []
    common: set[int] | None = None
    for path in sorted(Path(directory).glob("*-rank*.ckpt")):
        try:
            store = Store.open(path)
        except (OSError, FormatError):
            return None
        try:
            reports = scan(store)
            if store.layout.kind == "model":
                points = restore_points(path, reports)
                bases.update({step: point.report.record.step for step, point in points.items()})
                common = set(points) if common is None else common & set(points)
            else:
                rank_steps.append(set(valid_steps(reports)))
        finally:
            store.close()
    for steps in rank_steps:
        # A rank file written only with the full snapshots (replay) serves the steps of their logs.
        common = {t for t in common if t in steps or bases.get(t) in steps}
    return max(common) if common else None


def _describe_file(path: Path) -> list[str]:
    try:
        store = Store.open(path)
    except (OSError, FormatError) as exc:
        return [f"{path.name}  unreadable: {exc}"]
    try:
        layout = store.layout
        area_mb = layout.area_size() / 1e6
        what = f"{len(layout.slots)} layers" if layout.kind == "model" else "per-rank state"
        short = "" if store.size >= store.expected_size else \
            f", TRUNCATED to {store.size} of {store.expected_size} bytes"
        lines = [f"{path.name}  {layout.kind}, {what}, {AREAS} x {area_mb:.2f} MB = "
                 f"{store.expected_size / 1e6:.2f} MB{short}"]
        for report in scan(store):
            lines.append("  " + report.describe())
            chain = read_chain(log_path(path, report.area), report.record.generation, report.record.step,
                               verify=True) if report.valid else []
            if chain:
                lines.append(f"    + differential log: steps {chain[0].step}-{chain[-1].step} replayable")
        return lines
    finally:
        store.close()
