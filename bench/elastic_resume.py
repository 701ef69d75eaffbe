"""Resuming a checkpoint on another number of workers: two versions of convoy side by side, on one machine.

    flock -s /tmp/quiet.lock python bench/elastic_resume.py --prepare-only
    flock -x /tmp/quiet.lock python bench/elastic_resume.py --baseline 66ed2d8 --rounds 3

Prepares once (untimed, kept in ``--work``) a checkpoint of each job in
``--jobs`` written by ``--from`` workers (loopback, gloo), stopped ``--past``
steps after its last full snapshot, so that the step a resume goes on from lies
in the model file's differential log. Then, ``--rounds`` times, each job's
checkpoint is copied afresh and resumed on ``--to`` workers for no further
step (``convoy train --steps`` the checkpoint's step), once with the convoy of
``--baseline`` (a commit of this repository, or a tree with a ``convoy/``
package) and once with ``--candidate``'s (the same; default: this tree), their
order alternating from round to round. Each run's workers write ``convoy.utils.timeline`` marks;
recorded per run:

- ``restore_s``: from "model built" to "checkpoint restored", the slowest rank
  (the first step waits for it): rank 0's re-deal, the broadcast of its
  outcome, every rank's restore;
- ``redeal_s``: rank 0 from "model built" to "checkpoint mapped" (the re-deal);
- ``rank0_s``: rank 0 from "model built" to "checkpoint restored".

Writes bench/results/elastic_resume.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import save  # noqa: E402

COMMON = ["--batch-size", "15", "--seed", "1", "--no-progress", "--eval-every", "0", "--lr-schedule", "constant"]
JOBS = {
    "vgg_fc-blocktopk": ["--model", "vgg_fc", "--compress", "blocktopk", "--block-fraction", "0.01"],
    "vgg_fc-powersgd": ["--model", "vgg_fc", "--compress", "powersgd"],
}


def job_args(name: str, full_every: int) -> list[str]:
    return [*JOBS[name], *COMMON, "--checkpoint-full-every", str(full_every)]


def convoy(tree: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``convoy`` of the tree ``tree`` (its package first on the path), run to its end; it must succeed."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-m", "convoy", *args], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"convoy {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def tree_of(version: str, work: Path) -> Path:
    """A tree whose ``convoy/`` is ``version``: that directory, or the commit's package exported into ``work``."""
    if (Path(version) / "convoy").is_dir():
        return Path(version).resolve()
    tree = work / f"tree-{version}"
    if not (tree / "convoy").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", version, "convoy"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def prepare(work: Path, name: str, world: int, past: int) -> tuple[Path, int]:
    """The checkpoint of job ``name`` (made once): ``world`` workers, a full snapshot after the first
    step and ``past`` steps logged after it. Returns its directory and its step."""
    directory, step = work / name, 1 + past
    if not (directory / "model-rank0.ckpt").exists():
        shutil.rmtree(directory, ignore_errors=True)
        convoy(REPO, ["train", "--nproc", str(world), *job_args(name, 10 * step), "--steps", str(step),
                      "--checkpoint-dir", str(directory), "--out", str(work / f"{name}-run")])
    from convoy.checkpoint.files import model_file
    from convoy.checkpoint.recovery import restore_points, scan
    from convoy.checkpoint.store import Store
    store = Store.open(model_file(directory, 0))
    try:
        points = restore_points(model_file(directory, 0), scan(store))
    finally:
        store.close()
    point = points[max(points)]
    if point.step != step or len(point.updates) != past:
        raise SystemExit(f"{directory}: step {point.step}, {len(point.updates)} logged steps past its snapshot; "
                         f"expected {step} and {past} (remove it to make it again)")
    return directory, step


def resume(tree: Path, work: Path, name: str, checkpoint: Path, step: int, world: int) -> dict[str, float]:
    """Resume a fresh copy of ``checkpoint`` on ``world`` workers with the convoy of ``tree``; its times."""
    directory, timeline = work / "resumed", work / "timeline.jsonl"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(checkpoint, directory)
    timeline.unlink(missing_ok=True)
    done = convoy(tree, ["train", "--nproc", str(world), *job_args(name, 10 * step), "--steps", str(step),
                         "--checkpoint-dir", str(directory), "--out", str(work / "resumed-run")],
                  {"CONVOY_TIMELINE": str(timeline)})
    if f"re-dealt at step {step}" not in done.stderr:
        raise SystemExit(f"no re-deal at step {step}:\n{done.stderr[-3000:]}")
    marks: dict[tuple[int, str], float] = {}
    for line in timeline.read_text().splitlines():
        mark = json.loads(line)
        if mark["rank"] is not None:
            marks[(mark["rank"], mark["event"])] = mark["t"]
    ranks = range(world)
    return {"restore_s": max(marks[(r, "checkpoint restored")] - marks[(r, "model built")] for r in ranks),
            "redeal_s": marks[(0, "checkpoint mapped")] - marks[(0, "model built")],
            "rank0_s": marks[(0, "checkpoint restored")] - marks[(0, "model built")],
            "replayed": "differential steps replayed" in done.stderr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="the version to compare with: a commit, or a tree with a convoy/ package")
    parser.add_argument("--candidate", default=str(REPO),
                        help="the version compared: a commit, or a tree (default: this one)")
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--from", dest="old", type=int, default=4, help="workers that write the checkpoint")
    parser.add_argument("--to", type=int, default=3, help="workers that resume it")
    parser.add_argument("--past", type=int, default=40, help="steps logged after the last full snapshot")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/convoy-elastic-resume"))
    parser.add_argument("--prepare-only", action="store_true", help="make the checkpoints, time nothing")
    args = parser.parse_args()
    if not args.prepare_only and args.baseline is None:
        parser.error("--baseline is required (a commit, or a tree with a convoy/ package)")
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = {name: prepare(args.work, name, args.old, args.past) for name in args.jobs}
    if args.prepare_only:
        return
    trees = {"baseline": tree_of(args.baseline, args.work), "candidate": tree_of(args.candidate, args.work)}
    runs = []
    for round_ in range(args.rounds):
        for name in args.jobs:
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for version in order:
                times = resume(trees[version], args.work, name, *checkpoints[name], args.to)
                runs.append({"job": name, "version": version, "round": round_, **times})
                print(json.dumps(runs[-1]), flush=True)
    rows = []
    for name in args.jobs:
        for version in trees:
            mine = [r for r in runs if r["job"] == name and r["version"] == version]
            row = {"job": name, "version": version, "runs": len(mine),
                   "log applied by every rank": all(r["replayed"] for r in mine)}
            for key in ("restore_s", "redeal_s", "rank0_s"):
                values = [r[key] for r in mine]
                row[f"{key} median"] = statistics.median(values)
                row[f"{key} each"] = " ".join(f"{v:.2f}" for v in values)
            rows.append(row)
    columns = ["job", "version", "runs", "restore_s median", "restore_s each", "redeal_s median", "redeal_s each",
               "rank0_s median", "log applied by every rank"]
    save("elastic_resume", {"from": args.old, "to": args.to, "past": args.past, "rounds": args.rounds,
                            "jobs": {name: job_args(name, 10 * (1 + args.past)) for name in args.jobs},
                            "baseline": args.baseline, "candidate": args.candidate}, rows, columns)


if __name__ == "__main__":
    main()
