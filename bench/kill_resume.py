"""Kill-resume loop: a job SIGKILLed at a random moment after its first checkpoint, resumed, must end
bit-identical to an uninterrupted run.

    python bench/kill_resume.py --trials 10 -- --nproc 4 --model lenet --batch-size 8 --seed 3 --steps 120 \
        --no-progress --sync hierarchical --clusters 2 --exchange-every 2

Per trial: the job runs with ``--checkpoint-dir K``; 0-``--max-delay`` seconds (a seeded draw) after the
first model file appears in K its process group is SIGKILLed; the same command runs again to resume;
its run folder's model.pt is compared, every tensor with torch.equal, with the uninterrupted run's.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


def train(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "convoy", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def differences(a: Path, b: Path) -> list[str]:
    """Names of the tensors (model and momentum) that differ between two model.pt files, with the max diff."""
    x, y = torch.load(a), torch.load(b)
    out = [f"{k} {(v - y['model'][k]).abs().max().item():.3g}" for k, v in x["model"].items()
           if not torch.equal(v, y["model"][k])]
    for i, (o1, o2) in enumerate(zip(x.get("optimizers", []), y.get("optimizers", []))):
        for idx, st in o1["state"].items():
            for name, t in st.items():
                if torch.is_tensor(t) and not torch.equal(t, o2["state"][idx][name]):
                    out.append(f"optimizer {i} state {idx} {name}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None, help="first trial's seed (default: random)")
    parser.add_argument("--max-delay", type=float, default=3.0)
    parser.add_argument("--work", default="/tmp/kill_resume")
    parser.add_argument("job", nargs="+")
    ns = parser.parse_args()
    work = Path(ns.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    whole = train([*ns.job, "--out", str(work / "whole")])
    assert whole.wait() == 0, whole.stderr.read()
    seed = ns.seed if ns.seed is not None else random.SystemRandom().randrange(2**32)
    failures = 0
    for trial in range(ns.trials):
        rng = random.Random(seed + trial)
        delay = rng.uniform(0.0, ns.max_delay)
        ckpt, out_a, out_b = work / f"k{trial}", work / f"a{trial}", work / f"b{trial}"
        first = train([*ns.job, "--checkpoint-dir", str(ckpt), "--out", str(out_a)])
        while not list(ckpt.glob("model-rank*.ckpt")) and first.poll() is None:
            time.sleep(0.005)
        time.sleep(delay)
        killed = first.poll() is None
        with contextlib.suppress(ProcessLookupError):   # the job may have ended (a late draw)
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        resumed = train([*ns.job, "--checkpoint-dir", str(ckpt), "--out", str(out_b)])
        err = resumed.stderr.read()
        assert resumed.wait() == 0, err
        where = next((line for line in err.splitlines() if "resum" in line), "no resume line")
        diff = differences(work / "whole" / "model.pt", out_b / "model.pt")
        failures += bool(diff)
        print(f"trial {trial} seed {seed + trial} delay {delay:.2f}s killed={killed}: "
              f"{'IDENTICAL' if not diff else 'DIFFERS ' + '; '.join(diff[:4])} | {where.strip()}", flush=True)
    print(f"{ns.trials - failures}/{ns.trials} bit-identical")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
