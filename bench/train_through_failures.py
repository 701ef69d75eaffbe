"""Training through failures: a host killed every K steps, convoy going on with the survivors against
torch DDP + DCP checkpoints restarted by torchrun on the full world.

    flock /tmp/convoy-netns.lock python bench/train_through_failures.py --hosts 4 --rate 100mbit \\
        --model vgg_fc --kill-every 80

Every job runs as one torchrun agent per emulated host (c10d rendezvous served
by host 0's agent, network namespaces with shaped links; root needed), each
host capped at its even share of the machine's cores (``Topology.own_cores``:
a lost host takes its cores with it, as a real one does). Each strategy runs
twice, in this order: without failures, then with a host killed every K steps
(every process on it SIGKILLed at once, the agent included: a power cut).

- convoy (``convoy train`` with ``--checkpoint-dir``, which checkpoints every
  step by default) runs elastic, ``--nnodes 1:H``: the survivors' agents
  re-form the job without the lost host and convoy resumes its checkpoint on
  the smaller world, its global batch kept (convoy.train.elastic). A lost host
  does not come back: the job ends on the survivors. That is why the global
  batch must divide over H, H - 1, ... workers (``--batch-size 15``: 60 over
  4, 3, 2, 1), and why at most H - 1 hosts are killed.
- the DDP peer (bench/peers/ddp_train.py, a DCP checkpoint every
  ``--ddp-checkpoint-every`` steps) runs under a static ``--nnodes H`` with
  ``--max-restarts``: after a failure its agents wait for the full world, so
  the lost host is replaced, its agent started again ``--replace-after``
  seconds after the kill (0: at once, the peer's best case, a spare host
  standing by), and every worker restarts from the newest DCP checkpoint.

The failures fall at the same steps for every strategy: the i-th at the
first step from i x K that lies in the middle of the DDP peer's checkpoint
interval (its expected loss, not its best or worst case), on host H - i (host
0 serves the rendezvous, and losing it loses the job, so it is never killed).
A kill is sent when rank 0's metrics show the job reached the step, so it
lands there or a step later.

Recorded for each run, on the bench's clock from the agents' start (start-up,
failures and restarts included): the time to ``--also-target`` and to
``--target`` (the job stops there), the steps re-done (steps that a run
recorded before a failure and trained again after it: convoy records a step
when the next one ends, so it may have lost one more step than it shows),
restarts seen, the time down (from each kill to the first step the job
records after it: detection, rendezvous, start-up, resume), the final
accuracy and the hosts the job ended on. Writes
bench/results/train_through_failures_<model>_<rate>.{json,md,png}; the plot
is accuracy against wall time with the failures marked.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.figures import Block, load, number, percent, seconds, table, times  # noqa: E402
from bench.time_to_accuracy import PEER, STRATEGIES, strategy_command  # noqa: E402
from convoy.emulation import EmulatedCluster, Topology, parse_rate  # noqa: E402
from convoy.emulation.agents import agent_command, agent_environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# What an agent's workers print that says what happened to the job (resumes, re-deals, lost peers).
SAID = ("convoy:", "ddp_train:")
_POLL_S = 0.05


@dataclass(frozen=True)
class Failure:
    """The ``host`` killed once the job has trained ``step`` steps."""

    step: int
    host: int


def kill_schedule(kill_every: int, interval: int, steps: int, hosts: int, most: int | None = None) -> list[Failure]:
    """When and where the hosts die: the i-th failure at the first step from ``i * kill_every`` that lies
    mid-way through a checkpoint ``interval`` (``step % interval == interval // 2``), on host ``hosts - i``;
    before ``steps``, at most ``most`` failures (and never host 0, which serves the rendezvous).

    Args:
        kill_every: K, steps between failures.
        interval: the checkpoint interval the failures fall in the middle of.
        steps: the run's length; no failure at or after it.
        hosts: the cluster's hosts.
        most: at most this many failures (default: ``hosts - 1``, every host but the first).

    Example::

        >>> kill_schedule(80, 20, 400, 4)
        [Failure(step=90, host=3), Failure(step=170, host=2), Failure(step=250, host=1)]
    """
    if kill_every < 1 or interval < 1:
        raise ValueError(f"kill_every and interval must be >= 1, got {kill_every} and {interval}")
    most = hosts - 1 if most is None else min(most, hosts - 1)
    failures = []
    for i in range(1, most + 1):
        step = i * kill_every
        step += (interval // 2 - step) % interval
        if step >= steps:
            break
        failures.append(Failure(step, hosts - i))
    return failures


def steps_redone(lives: list[list[int]]) -> list[int]:
    """For each restart, how many steps the job trained again: those recorded before it (by any earlier
    life) from the step the next life resumed at. ``lives``: the step numbers each life recorded, in
    order (a life that recorded none re-does nothing, and the next one is compared with what came before).

    Example::

        >>> steps_redone([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6], [7, 8]])
        [3, 0]
    """
    done, redone = 0, []
    for i, life in enumerate(lives):
        if i and life:
            redone.append(max(0, done - min(life)))
        elif i:
            redone.append(0)
        if life:
            done = max(done, max(life) + 1)
    return redone


def time_to(curve: list[tuple[float, int, float]], level: float) -> tuple[float | None, int | None]:
    """The wall time and step of the first evaluation in ``curve`` ((time, step, accuracy) points) at
    ``level`` or above; (None, None) if none is."""
    return next(((t, step) for t, step, accuracy in curve if accuracy >= level), (None, None))


@dataclass
class MetricsTail:
    """Follows a metrics file that each life of a job rewrites from the start (``open(.., "w")``).

    Every :meth:`poll` returns the records appended since the last, each stamped with ``at``
    (seconds since ``began``) and ``life`` (0, then 1 after the file was started over, ...). A
    new life is seen when the file got shorter than what was read: a worker takes seconds to
    start and train a step, far longer than the polling interval.

    Example::

        >>> tail = MetricsTail(Path("run/metrics-rank0.jsonl"), began=time.monotonic())
        >>> tail.poll()   # [{"kind": "step", "step": 0, ..., "at": 1.9, "life": 0}, ...]
    """

    path: Path
    began: float
    life: int = 0
    _offset: int = 0
    _partial: str = ""

    def poll(self, now: float | None = None) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:   # rewritten: a new life of the job
            self.life, self._offset, self._partial = self.life + 1, 0, ""
        if size == self._offset:
            return []
        with open(self.path) as f:
            f.seek(self._offset)
            text = f.read(size - self._offset)
        self._offset = size
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()   # a line still being written
        at = (time.monotonic() if now is None else now) - self.began
        return [{**json.loads(line), "at": at, "life": self.life} for line in lines if line.strip()]


def _convoy(name: str) -> bool:
    return STRATEGIES[name][0] == "train"


def job_entry(name: str, args: argparse.Namespace, out: Path, checkpoints: Path) -> list[str]:
    """What torchrun starts on each host for strategy ``name``: its command from bench/time_to_accuracy.py
    with the run's flags, checkpointing into ``checkpoints``."""
    command = strategy_command(name, args, out)
    if _convoy(name):
        return ["-m", "convoy", *command, "--checkpoint-dir", str(checkpoints),
                "--timeout", str(args.collective_timeout)]
    return [*command, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(args.ddp_checkpoint_every)]


class Job:
    """One strategy's agents on a fresh emulated cluster, with their logs; hosts killed and replaced."""

    def __init__(self, name: str, cluster: EmulatedCluster, args: argparse.Namespace, work: Path):
        self.name, self.cluster, self.args, self.work = name, cluster, args, work
        self.entry = job_entry(name, args, work / "run", work / "ckpt")
        hosts = cluster.topology.hosts
        # convoy goes on with the survivors; the peer needs its full world back.
        self.nnodes = f"1:{hosts}" if _convoy(name) else str(hosts)
        self.agents: dict[int, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self._files: list[IO[str]] = []
        self.run_id = f"{name}-{os.getpid()}-{int(time.time())}"

    def start(self, host: int) -> None:
        log = self.work / f"agent-h{host}-{len(self.logs)}.log"
        self.logs.append(log)
        handle = open(log, "w")
        self._files.append(handle)
        argv = agent_command(self.cluster, host, self.run_id, self.entry, nnodes=self.nnodes,
                             agent=("--max-restarts", str(self.args.max_restarts)),
                             rdzv_conf=f"last_call_timeout={self.args.last_call}")
        # A host that joins a later round (the peer's replacement) needs the store published every round.
        env = agent_environment({"PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        self.agents[host] = subprocess.Popen(argv, cwd=self.work, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                             text=True, start_new_session=True)

    def kill(self, host: int) -> None:
        self.cluster.kill_host(host)
        self.agents[host].wait()

    def running(self) -> bool:
        return any(agent.poll() is None for agent in self.agents.values())

    def stop_all(self) -> None:
        for host in list(self.agents):
            if self.agents[host].poll() is None:
                self.kill(host)
        for handle in self._files:
            handle.close()

    def said(self) -> list[str]:
        return [line.strip() for log in self.logs for line in log.read_text(errors="replace").splitlines()
                if line.strip().startswith(SAID)]


def run_job(name: str, failures: list[Failure], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Strategy ``name`` to the target on a fresh cluster, ``failures`` injected; its row."""
    work.mkdir(parents=True)
    topology = Topology(args.hosts, parse_rate(args.rate), own_cores=True)
    with EmulatedCluster(topology) as cluster:
        job = Job(name, cluster, args, work)
        began = time.monotonic()
        for host in range(args.hosts):
            job.start(host)
        tail = MetricsTail(work / "run" / "metrics-rank0.jsonl", began)
        records: list[dict[str, Any]] = []
        pending, kills, replacements, done, world = list(failures), [], [], 0, None
        try:
            while job.running():
                now = time.monotonic()
                if now - began > args.job_timeout:
                    raise RuntimeError(f"{name}: not done after {args.job_timeout} s")
                for record in tail.poll(now):
                    records.append(record)
                    if world is None:   # every worker of the first life has opened its metrics file
                        world = len(list(tail.path.parent.glob("metrics-rank*.jsonl")))
                    if record["kind"] == "step":   # steps this life has trained (not an earlier life's)
                        done = record["step"] + 1 if record["life"] == tail.life else done
                if pending and done >= pending[0].step:
                    failure = pending.pop(0)
                    job.kill(failure.host)
                    kills.append({"step": done, "host": failure.host, "at": time.monotonic() - began,
                                  "life": tail.life})
                    if not _convoy(name):
                        replacements.append((time.monotonic() + args.replace_after, failure.host))
                    done = 0   # the next failure waits for the next life to reach its step
                for due, host in [r for r in replacements if r[0] <= now]:
                    job.start(host)
                    replacements.remove((due, host))
                time.sleep(_POLL_S)
            records += tail.poll()
        finally:
            job.stop_all()
        wall = time.monotonic() - began
        codes = {host: agent.returncode for host, agent in job.agents.items()}
        said = job.said()
    return {**summarize(name, failures, records, kills, codes, said, wall, args), "world_at_start": world}


def summarize(name: str, failures: list[Failure], records: list[dict[str, Any]], kills: list[dict[str, Any]],
              codes: dict[int, int], said: list[str], wall: float, args: argparse.Namespace) -> dict[str, Any]:
    """A run's row from rank 0's records (``at``, ``life``) and the kills made."""
    evals = [r for r in records if r["kind"] == "eval"]
    curve = [(r["at"], r["step"], r["test_accuracy"]) for r in evals]
    lives = [sorted(r["step"] for r in records if r["kind"] == "step" and r["life"] == life)
             for life in range(max((r["life"] for r in records), default=0) + 1)]
    redone = steps_redone(lives)
    firsts = {}   # each life's first record on the bench's clock
    for record in records:
        firsts.setdefault(record["life"], record["at"])
    down = [firsts[kill["life"] + 1] - kill["at"] for kill in kills if kill["life"] + 1 in firsts]
    t_target, s_target = time_to(curve, args.target)
    t_also, _ = time_to(curve, args.also_target)
    killed = {kill["host"] for kill in kills}
    # A convoy job ends on its survivors; the peer's replaced hosts must end well too.
    ending = {host: code for host, code in codes.items() if not (_convoy(name) and host in killed)}
    return {"strategy": name, "failures": f"every {args.kill_every}" if failures else "none",
            "peer": not _convoy(name), f"time_to_{args.also_target:g}_s": t_also, "time_to_target_s": t_target,
            "steps_to_target": s_target, "kills": len(kills), "restarts": len(lives) - 1,
            "steps_redone": sum(redone), "down_s": sum(down), "final_accuracy": curve[-1][2] if curve else None,
            "final_step": max((s for life in lives for s in life), default=-1) + 1,
            "hosts_at_end": len(ending), "wall_s": wall, "clean_exit": all(code == 0 for code in ending.values()),
            "kill_log": kills, "redone_per_restart": redone, "down_per_restart_s": down,
            "agent_exit_codes": codes, "said": said, "curve": curve}


def plot(rows: list[dict[str, Any]], path: Path, target: float, title: str = "") -> None:
    """Accuracy against wall time, one line per run (dashed: with failures), failures marked x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours: dict[str, str] = {}
    for row in rows:
        if not row["curve"]:
            continue
        failing = row["failures"] != "none"
        job = "DDP peer + DCP" if row.get("peer") else "convoy elastic"
        label = f"{row['strategy']} ({job}){', a host killed ' + row['failures'] if failing else ''}"
        kills = [kill["at"] for kill in row["kill_log"]]
        # One line per life of the job: nothing is trained between a kill and the restart.
        lives = [[p for p in row["curve"] if start <= p[0] < end]
                 for start, end in zip([0.0, *kills], [*kills, float("inf")])]
        for life in filter(None, lives):
            times, _, accuracy = zip(*life)
            line, = ax.plot(times, [100 * a for a in accuracy], linestyle="--" if failing else "-", marker="o",
                            markersize=2.5, color=colours.get(row["strategy"]), label=label)
            colours.setdefault(row["strategy"], line.get_color())
            label = None
        for at in kills:
            ax.axvline(at, color=colours[row["strategy"]], linestyle=":", linewidth=0.8)
            ax.plot([at], [100 * target + 1.5], marker="x", color=colours[row["strategy"]])
    ax.axhline(100 * target, color="grey", linestyle=":")
    ax.set_ylim(0, 100 * target + 3)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("wall time from the agents' start (s); x: a host killed")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


ELIGIBLE = [name for name, command in STRATEGIES.items()
            if (command[0] == "train" and not {"--sync", "--parallel"} & set(command))
            or (command[0] == PEER and "--no-exchange" not in command)]
COLUMNS = ["strategy", "failures", "time_to_0.95_s", "time_to_target_s", "steps_to_target", "kills", "restarts",
           "steps_redone", "down_s", "final_accuracy", "hosts_at_end", "wall_s", "clean_exit"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each host's link, e.g. 100mbit")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=15, help="per worker at the start; the global batch "
                        "(x --hosts) must divide over every smaller world convoy goes on with (default: 15, "
                        "time_to_accuracy's 16 made to divide over 4, 3, 2 and 1)")
    parser.add_argument("--steps", type=int, default=400, help="give up after this many steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--also-target", type=float, default=0.95)
    parser.add_argument("--warmup-steps", type=int, default=None, help="convoy's compressors' warm-up (default: "
                        "convoy train's own)")
    parser.add_argument("--strategies", nargs="+", default=["blocktopk", "convoy-powersgd", "powersgd"],
                        choices=ELIGIBLE, help="convoy data-parallel strategies and DDP peers of "
                        "bench/time_to_accuracy.py (default: blocktopk convoy-powersgd powersgd, the last DDP + "
                        "torch's PowerSGD hook, rank 2)")
    parser.add_argument("--kill-every", type=int, default=80, help="K: a host dies every K steps")
    parser.add_argument("--max-failures", type=int, default=None, help="at most this many (default: hosts - 1)")
    parser.add_argument("--ddp-checkpoint-every", type=int, default=20, help="the DDP peer's DCP checkpoint "
                        "interval, in steps (the failures fall mid-way through one)")
    parser.add_argument("--replace-after", type=float, default=0.0, help="seconds after a kill until the DDP "
                        "peer's host is back (default: 0, a spare standing by)")
    parser.add_argument("--last-call", type=int, default=5, help="seconds the rendezvous waits for more "
                        "hosts once it has the fewest it takes (convoy's elastic jobs: also at the start)")
    parser.add_argument("--max-restarts", type=int, default=8, help="torchrun --max-restarts")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="convoy train --timeout")
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="give a run up after this many seconds")
    parser.add_argument("--no-failures-only", action="store_true", help="only the runs without failures")
    parser.add_argument("--work", help="keep the runs' folders, checkpoints and agents' logs here (default: a "
                        "temporary folder, removed)")
    parser.add_argument("--tag", help="suffix of the result files' names")
    args = parser.parse_args()
    args.cluster = None   # strategy_command reads it (no cluster file: --hosts and --rate)
    failures = kill_schedule(args.kill_every, args.ddp_checkpoint_every, args.steps, args.hosts, args.max_failures)
    # The worlds convoy goes on with after each failure.
    bad = [world for world in range(args.hosts - len(failures), args.hosts) if args.batch_size * args.hosts % world]
    if bad and not args.no_failures_only:
        print(f"train_through_failures: error: the global batch ({args.batch_size} x {args.hosts} hosts) does not "
              f"divide over {', '.join(map(str, bad))} workers, so convoy could not go on; try --batch-size 15",
              file=sys.stderr)
        sys.exit(2)
    load_before = os.getloadavg()[0]
    print(f"failures: {', '.join(f'host {f.host} at step {f.step}' for f in failures)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-failures-") as tmp:
        tmp = args.work or tmp
        for name in args.strategies:
            for injected in ([[]] if args.no_failures_only else [[], failures]):
                work = Path(tmp, f"{name}-{'failures' if injected else 'none'}")
                try:
                    rows.append(run_job(name, injected, args, work))
                except RuntimeError as exc:   # one failing run must not lose the others' figures
                    print(exc, file=sys.stderr, flush=True)
                    rows.append({"strategy": name, "failures": "none" if not injected else f"every {args.kill_every}",
                                 "error": str(exc), "curve": [], "kill_log": [], "clean_exit": False})
                print({k: v for k, v in rows[-1].items() if k not in ("curve", "said")}, flush=True)
    name = f"train_through_failures_{args.model}_{args.rate}" + (f"_{args.tag}" if args.tag else "")
    settings = {**vars(args), "schedule": [asdict(f) for f in failures], "cpus": os.cpu_count(),
                "load_average_1min": [load_before, os.getloadavg()[0]]}
    save(name, settings, rows, [c.replace("0.95", f"{args.also_target:g}") for c in COLUMNS])
    plot(rows, RESULTS / f"{name}.png", args.target, title=f"{args.model}, {args.hosts} emulated hosts at {args.rate}, "
         f"each with {len(os.sched_getaffinity(0)) / args.hosts:g} cores; dashed: a host killed every "
         f"{args.kill_every} steps")


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_train_through_failures(name: str) -> str:
    """Each run: times to the two levels, what its failures cost against the same strategy's run without
    them (its time over that one's), work re-done, time down."""
    data = load(name) or {}
    settings, rows = data.get("settings", {}), data.get("rows", [])
    also, target = f"time_to_{settings.get('also_target', 0.95):g}_s", settings.get("target", 0.97)
    calm = {r["strategy"]: r for r in rows if r["failures"] == "none"}

    def cost(row: dict, key: str) -> str:
        base = calm.get(row["strategy"], {}).get(key)
        if row["failures"] == "none" or not row.get(key):
            return "-"
        return times(row[key] / base) if base else "not reached without failures"
    cells = []
    for r in rows:
        job = "DDP + DCP, torchrun restarts" if r.get("peer") else "convoy, elastic"
        failures = "none" if r["failures"] == "none" else \
            f"a host {r['failures']} steps ({r.get('kills', 0)} killed)"
        if "error" in r:
            cells.append([r["strategy"], job, failures, f"failed: {r['error']}", *["-"] * 9])
            continue
        cells.append([r["strategy"], job, failures, seconds(r.get(also), "not reached"), cost(r, also),
                      seconds(r.get("time_to_target_s"), "not reached"), cost(r, "time_to_target_s"),
                      number(r.get("steps_redone")), number(r.get("restarts")),
                      f"{seconds(r['down_s'])} ({seconds(r['down_s'] / r['kills'])} each)" if r.get("kills")
                      else "-",
                      percent(r.get("final_accuracy")), number(r.get("hosts_at_end")),
                      "yes" if r.get("clean_exit") else "no"])
    return table(["strategy", "job", "failures", f"time to {settings.get('also_target', 0.95):.0%}",
                  "vs no failures", f"time to {target:.0%}", "vs no failures", "steps re-done", "restarts",
                  "time down", "final accuracy", "hosts at the end", "clean exit"], cells)


BLOCKS = (
    Block("train_through_failures", "Training through failures: vgg_fc, 4 hosts at 100 Mbit, a host killed every "
          "80 steps", ("train_through_failures_vgg_fc_100mbit",),
          "torch DDP + torch's PowerSGD hook (rank 2) with a DCP checkpoint every 20 steps, restarted by torchrun "
          "on the full world (the lost host replaced at once), in the same run; and each strategy without failures",
          partial(render_train_through_failures, "train_through_failures_vgg_fc_100mbit"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80",
          emulated=True),
)


if __name__ == "__main__":
    main()
