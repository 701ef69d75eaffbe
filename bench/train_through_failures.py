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
  ``--ddp-checkpoint-every`` steps; ``tuned-peer``: torch's PowerSGD hook at
  the rank that reached the target soonest in bench/time_to_accuracy.py's
  sweep of tuned peers for the same model and rate, read from its result
  file, or ``--peer-rank``) runs under a static ``--nnodes H`` with
  ``--max-restarts``: after a failure its agents wait for the full world, so
  the lost host is replaced, its agent started again ``--replace-after``
  seconds after the kill (0: at once, the peer's best case, a spare host
  standing by), and every worker restarts from the newest DCP checkpoint.
- ``--convoy-replaced`` adds, for each convoy strategy, a run with the same
  failures in which the lost host is replaced as the peer's is: its agent
  started again ``--replace-after`` seconds after the kill, on the same
  emulated host (its address and its cores). Still ``--nnodes 1:H``: the
  replacement's agent waits in the rendezvous until the round the survivors
  left is over (the lost host's keep-alive expires), then joins the next one
  with them, and the job re-forms on H hosts; convoy resumes its newest step
  on the world that wrote it (nothing re-dealt). If the replacement comes
  after that round closed without it, it asks for another: the job re-forms
  twice, the time down counts for the same failure until the first step
  recorded on the full world (``restarts`` counts the survivors' world only
  if it recorded a step). These rows are ``<strategy> (host replaced)``; with
  ``--timeline`` each run records the rounds the job re-formed in after each
  kill (``rounds_after_kill``: their world, hosts and time).
- ``--peer-elastic`` adds, for each DDP peer, a run with the same failures
  and no spare: ``--nnodes 1:H``, as a DDP user without one would run it. The
  survivors' agents re-form the job and every worker resumes the newest DCP
  checkpoint (its state is replicated, so it loads on any world), each
  worker's batch unchanged: the global batch shrinks with the world, and the
  hook's state starts afresh as after any restart. Rows ``<peer> (elastic)``.

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
accuracy and the hosts the job ended on; with ``--timeline``, when each step
of every recovery happened (``downtime_parts``: the agents' time-stamped log
lines, the workers' ``convoy.utils.timeline`` marks). Every agent's rendezvous
takes ``convoy.emulation.agents.FAST_RENDEZVOUS`` unless ``--last-call`` and
``--keep-alive`` say otherwise. Writes
bench/results/train_through_failures_<model>_<rate>.{json,md,png}; the plot
is accuracy against wall time with the failures marked.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
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
from bench.time_to_accuracy import PEER, STRATEGIES, strategy_command, tuned_peer_rank  # noqa: E402
from convoy.emulation import EmulatedCluster, Topology, parse_rate  # noqa: E402
from convoy.emulation.agents import FAST_RENDEZVOUS, agent_command, agent_environment, rdzv_conf  # noqa: E402
from convoy.utils import timeline  # noqa: E402

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


TIMELINE = "timeline.jsonl"   # the workers' marks (convoy.utils.timeline), every life's, in the run's folder
# A torch log line: level, month, day, time, pid, source] message (the agents log so with LOGLEVEL=INFO).
_TORCH_LOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) +\d+ \S+\] (.*)$")
# What an agent logs on the way from its worker's failure to the next workers: (part, what the line says).
AGENT_STEPS = (("agent saw the worker fail", "failed (exitcode"), ("rendezvous complete", "Rendezvous complete for"),
               ("workers started", "Starting worker group"))
# The workers' marks, in the order a life of the job passes them.
WORKER_STEPS = ("exec", "imported", "process group", "dataset loaded", "model built", "checkpoint mapped",
                "checkpoint restored", "replay ended", "first step")


def agent_events(log: Path) -> list[tuple[float, str]]:
    """(wall time, message) of each torch log line of an agent's log (this year's dates assumed)."""
    year, out = datetime.date.today().year, []
    for line in log.read_text(errors="replace").splitlines():
        match = _TORCH_LOG.match(line)
        if match:
            month, day, hour, minute, sec, message = match.groups()
            stamp = datetime.datetime(year, int(month), int(day), int(hour), int(minute)) + \
                datetime.timedelta(seconds=float(sec))
            out.append((stamp.timestamp(), message))
    return out


def downtime_parts(kills: list[dict[str, Any]], logs: list[Path], marks: Path) -> list[dict[str, float]]:
    """For each kill, when each step of the recovery happened, in seconds after the kill: the
    agents' (:data:`AGENT_STEPS`, from their time-stamped logs) and the new workers'
    (:data:`WORKER_STEPS`, their timeline marks), each the latest over the agents or ranks, as
    the job goes on only once all of them are there."""
    events = [event for log in logs for event in agent_events(log)]
    worker = [json.loads(line) for line in marks.read_text().splitlines()] if marks.exists() else []
    out = []
    for i, kill in enumerate(kills):
        start = kill["wall"]
        end = kills[i + 1]["wall"] if i + 1 < len(kills) else float("inf")
        parts: dict[str, float] = {}
        for part, says in AGENT_STEPS:
            times = [t for t, message in events if start <= t < end and says in message]
            if times:
                parts[part] = max(times) - start
        for step in WORKER_STEPS:
            times = [m["t"] for m in worker if m["event"] == step and start <= m["t"] < end]
            if times:
                parts[step] = max(times) - start
        out.append(parts)
    return out


def rounds_joined(kills: list[dict[str, Any]], logs: list[Path]) -> list[list[dict[str, Any]]]:
    """For each kill, the rendezvous rounds completed after it (before the next kill), in order, from
    the agents' logs at ``LOGLEVEL=INFO`` (their "Rendezvous complete" result: a round is one master
    address and port): its ``world`` (``group_world_size``), the ``hosts`` whose agents joined it (from
    the logs' names, ``agent-h<host>-<n>.log``) and when the last of them did (``at``, s after the kill).

    Two rounds after one kill: the job re-formed twice, e.g. a replacement host that joined after
    the survivors' round had closed, and asked for another.

    Example::

        >>> rounds_joined([{"wall": t0}], logs)   # host 2 replaced at once, in the survivors' round
        [[{"world": 3, "hosts": [0, 1, 2], "at": 6.6}]]
    """
    joins = []   # (time, the round's master address and port, world, host)
    for log in logs:
        host = int(re.search(r"agent-h(\d+)-", log.name).group(1))
        master = None
        for t, message in agent_events(log):
            if message.strip().startswith(("master_addr=", "master_port=")):
                master = (master or "") + message.strip()
            elif message.strip().startswith("group_world_size="):
                joins.append((t, master, int(message.strip().split("=")[1]), host))
            elif "Rendezvous complete for" in message:
                master = None
    out = []
    for i, kill in enumerate(kills):
        start = kill["wall"]
        end = kills[i + 1]["wall"] if i + 1 < len(kills) else float("inf")
        rounds: dict[Any, dict[str, Any]] = {}
        for t, master, world, host in sorted(joins):
            if start <= t < end:
                entry = rounds.setdefault(master, {"world": world, "hosts": [], "at": 0.0})
                entry["hosts"] = sorted({*entry["hosts"], host})
                entry["at"] = max(entry["at"], t - start)
        out.append(sorted(rounds.values(), key=lambda r: r["at"]))
    return out


def print_downtime(name: str, parts: list[dict[str, float]]) -> None:
    """Each kill's recovery: every step's time after the kill and since the step before."""
    for i, steps in enumerate(parts):
        print(f"{name}: failure {i + 1}, seconds after the kill (latest agent or rank), and since the step before:")
        last = 0.0
        for step, at in sorted(((s, t) for s, t in steps.items() if t is not None), key=lambda item: item[1]):
            print(f"  {step:28s} {at:7.2f}  +{at - last:.2f}")
            last = at


TUNED = "tuned-peer"   # --strategies: DDP + PowerSGD at the rank tuned_peer_rank finds (or --peer-rank)


def _convoy(words: list[str]) -> bool:
    return words[0] == "train"


def job_entry(name: str, words: list[str], args: argparse.Namespace, out: Path, checkpoints: Path) -> list[str]:
    """What torchrun starts on each host for strategy ``name`` (``words``: its own, as in
    bench/time_to_accuracy.py's STRATEGIES): its command with the run's flags, checkpointing into
    ``checkpoints``."""
    command = strategy_command(name, args, out, words)
    if _convoy(words):
        every = [] if args.convoy_checkpoint_every is None else ["--checkpoint-every", args.convoy_checkpoint_every]
        return ["-m", "convoy", *command, "--checkpoint-dir", str(checkpoints), *every,
                "--timeout", str(args.collective_timeout)]
    return [*command, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(args.ddp_checkpoint_every)]


class Job:
    """One strategy's agents on a fresh emulated cluster, with their logs; hosts killed and replaced.
    ``elastic``: the agents admit 1 to H hosts (``--nnodes 1:H``), else exactly H."""

    def __init__(self, name: str, words: list[str], cluster: EmulatedCluster, args: argparse.Namespace, work: Path,
                 elastic: bool):
        self.name, self.cluster, self.args, self.work = name, cluster, args, work
        self.entry = job_entry(name, words, args, work / "run", work / "ckpt")
        hosts = cluster.topology.hosts
        self.nnodes = f"1:{hosts}" if elastic else str(hosts)
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
                             rdzv_conf=rdzv_conf(last_call_timeout=self.args.last_call,
                                                 keep_alive_interval=self.args.keep_alive[0],
                                                 keep_alive_max_attempt=self.args.keep_alive[1]))
        # A host that joins a later round (the peer's replacement) needs the store published every round.
        extra = {"PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if self.args.timeline:   # the agents' rendezvous steps (time-stamped) and the workers' marks
            extra.update({"LOGLEVEL": "INFO", timeline.ENV: str(self.work / TIMELINE)})
        env = agent_environment(extra)
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


def run_job(name: str, words: list[str], failures: list[Failure], args: argparse.Namespace,
            work: Path, replaced: bool = False) -> dict[str, Any]:
    """Strategy ``name`` (``words``: its own) to the target on a fresh cluster, ``failures`` injected; its row.
    ``replaced``: a lost host's agent is started again ``args.replace_after`` seconds after the kill, on the
    same emulated host (its address and its cores); a convoy job then re-forms on the full world (``--nnodes
    1:H`` admits it) instead of going on with the survivors. A peer whose lost hosts are replaced runs under a
    static ``--nnodes H`` (it waits for its full world); one whose are not, under ``--nnodes 1:H`` (torchrun
    re-forms it on the survivors, each worker's batch unchanged, as DDP goes on)."""
    elastic = _runs_elastic(not _convoy(words), bool(failures), replaced)
    work.mkdir(parents=True)
    topology = Topology(args.hosts, parse_rate(args.rate), own_cores=True)
    with EmulatedCluster(topology) as cluster:
        job = Job(name, words, cluster, args, work, elastic)
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
                                  "life": tail.life, "wall": time.time()})
                    if replaced:
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
        parts = downtime_parts(kills, job.logs, work / TIMELINE) if args.timeline else None
        rounds = rounds_joined(kills, job.logs) if args.timeline else None
    row = {**summarize(name, failures, records, kills, codes, said, wall, args, peer=not _convoy(words),
                       replaced=replaced), "world_at_start": world}
    if rounds is not None:
        row["rounds_after_kill"] = rounds
    if parts is not None:
        first_records = [row["down_per_restart_s"][i] if i < len(row["down_per_restart_s"]) else None
                         for i in range(len(kills))]
        row["downtime_parts"] = [{**p, "first step recorded": d} for p, d in zip(parts, first_records)]
    return row


def summarize(name: str, failures: list[Failure], records: list[dict[str, Any]], kills: list[dict[str, Any]],
              codes: dict[int, int], said: list[str], wall: float, args: argparse.Namespace,
              peer: bool, replaced: bool | None = None) -> dict[str, Any]:
    """A run's row from rank 0's records (``at``, ``life``) and the kills made; ``peer``: a DDP peer's run;
    ``replaced``: its lost hosts were replaced (default: a peer's are).

    A restart no kill caused (a replacement that joined after the survivors' round closed asks for
    another) is part of the kill before it: its time down, from the last record of the life it
    stopped to the first of the next, is added to that kill's."""
    replaced = peer if replaced is None else replaced
    evals = [r for r in records if r["kind"] == "eval"]
    curve = [(r["at"], r["step"], r["test_accuracy"]) for r in evals]
    lives = [sorted(r["step"] for r in records if r["kind"] == "step" and r["life"] == life)
             for life in range(max((r["life"] for r in records), default=0) + 1)]
    redone = steps_redone(lives)
    firsts, lasts = {}, {}   # each life's first and last record on the bench's clock
    for record in records:
        firsts.setdefault(record["life"], record["at"])
        lasts[record["life"]] = record["at"]
    down = [firsts[kill["life"] + 1] - kill["at"] for kill in kills if kill["life"] + 1 in firsts]
    killed_lives = {kill["life"] for kill in kills}
    for life in sorted(firsts):   # the lives that ended without a kill, but for the last
        if life in killed_lives or life + 1 not in firsts:
            continue
        before = [i for i, kill in enumerate(kills) if kill["life"] < life]
        if before and before[-1] < len(down):
            down[before[-1]] += firsts[life + 1] - lasts[life]
    t_target, s_target = time_to(curve, args.target)
    t_also, _ = time_to(curve, args.also_target)
    killed = {kill["host"] for kill in kills}
    # A convoy job ends on its survivors; replaced hosts (the peer's, always) must end well too.
    ending = {host: code for host, code in codes.items() if replaced or host not in killed}
    return {"strategy": name, "failures": f"every {args.kill_every}" if failures else "none",
            "peer": peer, "replaced": bool(failures) and replaced, f"time_to_{args.also_target:g}_s": t_also, "time_to_target_s": t_target,
            "steps_to_target": s_target, "kills": len(kills), "restarts": len(lives) - 1,
            "steps_redone": sum(redone), "down_s": sum(down), "final_accuracy": curve[-1][2] if curve else None,
            "final_step": max((s for life in lives for s in life), default=-1) + 1,
            "hosts_at_end": len(ending), "wall_s": wall, "clean_exit": all(code == 0 for code in ending.values()),
            "kill_log": kills, "redone_per_restart": redone, "down_per_restart_s": down,
            "agent_exit_codes": codes, "said": said, "curve": curve}


def plot(rows: list[dict[str, Any]], path: Path, target: float, title: str = "") -> None:
    """Accuracy against wall time, one line per run (dashed: with failures; dash-dotted: with failures and
    convoy's lost hosts replaced), failures marked x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours: dict[str, str] = {}
    for row in rows:
        if not row["curve"]:
            continue
        failing = row["failures"] != "none"
        job = ("DDP peer + DCP, elastic" if _elastic_peer(row) else "DDP peer + DCP") if row.get("peer") else \
            "convoy elastic, host replaced" if row.get("replaced") else "convoy elastic"
        label = f"{row['strategy']} ({job}){', a host killed ' + row['failures'] if failing else ''}"
        style = "-" if not failing else "-." if (row.get("replaced") and not row.get("peer")) or _elastic_peer(row) \
            else "--"
        kills = [kill["at"] for kill in row["kill_log"]]
        # One line per life of the job: nothing is trained between a kill and the restart.
        lives = [[p for p in row["curve"] if start <= p[0] < end]
                 for start, end in zip([0.0, *kills], [*kills, float("inf")])]
        for life in filter(None, lives):
            times, _, accuracy = zip(*life)
            line, = ax.plot(times, [100 * a for a in accuracy], linestyle=style, marker="o",
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


def planned_runs(strategies: list[str], commands: dict[str, list[str]], failures: list[Failure],
                 args: argparse.Namespace) -> list[tuple[str, list[Failure], bool]]:
    """The runs, in order: (strategy, failures injected, lost hosts replaced) for each strategy, without
    failures, then with them (``--no-failures-only``, ``--failures-only``): a convoy strategy's lost
    hosts are not replaced (it goes on with the survivors), a DDP peer's are. With ``--convoy-replaced``,
    a convoy strategy's run with failures once more, its lost hosts replaced as the peer's are; with
    ``--peer-elastic``, a peer's once more, its lost hosts not replaced (torchrun elastic).

    Example::

        >>> planned_runs(["blocktopk", "ddp-powersgd-r4"], commands, schedule, args)   # --convoy-replaced
        [("blocktopk", [], False), ("blocktopk", schedule, False), ("blocktopk", schedule, True),
         ("ddp-powersgd-r4", [], False), ("ddp-powersgd-r4", schedule, True)]
    """
    runs = []
    for name in strategies:
        convoy = _convoy(commands[name])
        injected = [[]] if args.no_failures_only else [failures] if args.failures_only else [[], failures]
        for each in injected:
            runs.append((name, each, bool(each) and not convoy))
            if each and (args.convoy_replaced if convoy else args.peer_elastic):
                runs.append((name, each, convoy))   # the other case: replaced for convoy, not for the peer
    return runs


def run_label(row: dict[str, Any]) -> str:
    """A run's name in the tables and the plot: its strategy, and whether its lost hosts were handled
    otherwise than its kind's first run with failures (convoy's replaced, the peer's not)."""
    if row.get("peer"):
        return f"{row['strategy']} (elastic)" if _elastic_peer(row) else row["strategy"]
    return f"{row['strategy']} (host replaced)" if row.get("replaced") else row["strategy"]


def _runs_elastic(peer: bool, failing: bool, replaced: bool) -> bool:
    """Whether a run's agents admit 1 to H hosts: convoy's always; a DDP peer's only when it has failures
    and its lost hosts are not replaced (else it waits for its full world)."""
    return not peer or (failing and not replaced)


def _elastic_peer(row: dict[str, Any]) -> bool:
    """A peer's run that ran elastic (torchrun --nnodes 1:H, its lost hosts not replaced)."""
    return bool(row.get("peer")) and _runs_elastic(True, row.get("failures", "none") != "none",
                                                   bool(row.get("replaced")))


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
    parser.add_argument("--strategies", nargs="+", default=["blocktopk", "convoy-powersgd", TUNED],
                        choices=ELIGIBLE + [TUNED], help="convoy data-parallel strategies and DDP peers of "
                        f"bench/time_to_accuracy.py, and {TUNED}: DDP + torch's PowerSGD hook at the tuned rank "
                        f"(see --peer-rank; default: blocktopk convoy-powersgd {TUNED})")
    parser.add_argument("--peer-rank", type=int, help=f"the PowerSGD rank of {TUNED} (default: that of the DDP + "
                        "PowerSGD peer soonest to its target in bench/time_to_accuracy.py's sweep of tuned peers for "
                        "the same --model and --rate, read from its result file)")
    parser.add_argument("--kill-every", type=int, default=80, help="K: a host dies every K steps")
    parser.add_argument("--max-failures", type=int, default=None, help="at most this many (default: hosts - 1)")
    parser.add_argument("--ddp-checkpoint-every", type=int, default=20, help="the DDP peer's DCP checkpoint "
                        "interval, in steps (the failures fall mid-way through one)")
    parser.add_argument("--convoy-checkpoint-every", metavar="N|auto", help="convoy train --checkpoint-every for "
                        "the convoy jobs (default: convoy's own, every step)")
    parser.add_argument("--replace-after", type=float, default=0.0, help="seconds after a kill until the DDP "
                        "peer's host is back, and convoy's with --convoy-replaced (default: 0, a spare standing by)")
    parser.add_argument("--convoy-replaced", action="store_true", help="also run each convoy strategy with "
                        "failures and its lost host replaced as the peer's is (--replace-after; the same emulated "
                        "host, its cores included): the rendezvous re-forms the full world and convoy resumes on "
                        "it; rows '<strategy> (host replaced)' beside those that go on with the survivors")
    parser.add_argument("--peer-elastic", action="store_true", help="also run each DDP peer with failures under "
                        "torchrun --nnodes 1:H, its lost host not replaced: the survivors re-form the job and "
                        "resume the newest DCP checkpoint, each worker's batch unchanged (the global batch "
                        "shrinks, as DDP goes on); rows '<peer> (elastic)' beside the peer's run with a spare")
    parser.add_argument("--last-call", type=int, default=FAST_RENDEZVOUS["last_call_timeout"], help="seconds the "
                        "rendezvous waits for more hosts once it has the fewest it takes (convoy's elastic jobs: "
                        "also at the start; default: convoy.emulation.agents.FAST_RENDEZVOUS's)")
    parser.add_argument("--keep-alive", type=int, nargs=2, metavar=("SECONDS", "BEATS"),
                        default=[FAST_RENDEZVOUS["keep_alive_interval"], FAST_RENDEZVOUS["keep_alive_max_attempt"]],
                        help="a host's keep-alive interval and the beats it may miss before the rendezvous drops "
                        "it (a lost host is dropped that long after its last beat; default: FAST_RENDEZVOUS's)")
    parser.add_argument("--max-restarts", type=int, default=8, help="torchrun --max-restarts")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="convoy train --timeout")
    parser.add_argument("--job-timeout", type=float, default=1800.0, help="give a run up after this many seconds")
    parser.add_argument("--no-failures-only", action="store_true", help="only the runs without failures")
    parser.add_argument("--failures-only", action="store_true", help="only the runs with failures")
    parser.add_argument("--timeline", action="store_true", help="time each step of every recovery (the agents "
                        "log at INFO, the workers mark their start-up: convoy.utils.timeline) and record it "
                        "as each run's downtime_parts")
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
    commands = {name: STRATEGIES[name] for name in args.strategies if name != TUNED}
    if TUNED in args.strategies:
        if args.peer_rank is not None:
            if args.peer_rank < 1:
                print(f"train_through_failures: error: --peer-rank must be >= 1, got {args.peer_rank}",
                      file=sys.stderr)
                sys.exit(2)
            args.peer_rank_why = f"--peer-rank {args.peer_rank}, as given"
        else:
            try:
                args.peer_rank, args.peer_rank_why = tuned_peer_rank(args.model, args.rate)
            except ValueError as exc:
                print(f"train_through_failures: error: {exc}; or pass --peer-rank", file=sys.stderr)
                sys.exit(2)
        peer = f"ddp-powersgd-r{args.peer_rank}"
        commands[peer] = [PEER, "--powersgd-rank", str(args.peer_rank)]
        args.strategies = [peer if name == TUNED else name for name in args.strategies]
        print(f"peer: DDP + PowerSGD at rank {args.peer_rank} ({args.peer_rank_why})", flush=True)
    load_before = os.getloadavg()[0]
    print(f"failures: {', '.join(f'host {f.host} at step {f.step}' for f in failures)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-failures-") as tmp:
        tmp = args.work or tmp
        for name, injected, replaced in planned_runs(args.strategies, commands, failures, args):
            work = Path(tmp, f"{name}-{'none' if not injected else 'replaced' if replaced else 'failures'}")
            try:
                rows.append(run_job(name, commands[name], injected, args, work, replaced=replaced))
            except RuntimeError as exc:   # one failing run must not lose the others' figures
                print(exc, file=sys.stderr, flush=True)
                rows.append({"strategy": name, "failures": "none" if not injected else f"every {args.kill_every}",
                             "peer": not _convoy(commands[name]), "replaced": replaced, "error": str(exc),
                             "curve": [], "kill_log": [], "clean_exit": False})
            print({k: v for k, v in rows[-1].items() if k not in ("curve", "said", "downtime_parts")},
                  flush=True)
            if rows[-1].get("downtime_parts"):
                print_downtime(run_label(rows[-1]), rows[-1]["downtime_parts"])
    name = f"train_through_failures_{args.model}_{args.rate}" + (f"_{args.tag}" if args.tag else "")
    settings = {**vars(args), "schedule": [asdict(f) for f in failures], "cpus": os.cpu_count(),
                "load_average_1min": [load_before, os.getloadavg()[0]]}
    save(name, settings, rows, [c.replace("0.95", f"{args.also_target:g}") for c in COLUMNS])
    plot(rows, RESULTS / f"{name}.png", args.target, title=f"{args.model}, {args.hosts} emulated hosts at {args.rate}, "
         f"each with {len(os.sched_getaffinity(0)) / args.hosts:g} cores; dashed: a host killed every "
         f"{args.kill_every} steps" + ("; dash-dotted: convoy's lost host replaced" if args.convoy_replaced else ""))


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def peer_line(settings: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Which PowerSGD rank the run's DDP peer had, and why (runs before --peer-rank: their strategy's)."""
    if settings.get("peer_rank"):
        return f"The peer: DDP + PowerSGD at rank {settings['peer_rank']} ({settings.get('peer_rank_why', '')}).\n\n"
    ranks = {STRATEGIES[r["strategy"]][2] for r in rows if r.get("peer") and r["strategy"] in STRATEGIES
             and STRATEGIES[r["strategy"]][1:2] == ["--powersgd-rank"]}
    return f"The peer: DDP + PowerSGD at rank {', '.join(sorted(ranks))}, as the run named it.\n\n" if ranks else ""


def replaced_when(settings: dict[str, Any]) -> str:
    """When a lost host came back, in words (``--replace-after``)."""
    after = settings.get("replace_after", 0.0)
    return " at once" if not after else f" {after:g} s after the kill"


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
        job = ("DDP + DCP, torchrun elastic, on the survivors" if _elastic_peer(r) else
               "DDP + DCP, torchrun restarts") if r.get("peer") else \
            f"convoy, elastic, lost host replaced{replaced_when(settings)}" if r.get("replaced") else \
            "convoy, elastic" if r["failures"] == "none" else "convoy, elastic, on the survivors"
        failures = "none" if r["failures"] == "none" else \
            f"a host {r['failures']} steps ({r.get('kills', 0)} killed)"
        if "error" in r:
            cells.append([run_label(r), job, failures, f"failed: {r['error']}", *["-"] * 9])
            continue
        cells.append([run_label(r), job, failures, seconds(r.get(also), "not reached"), cost(r, also),
                      seconds(r.get("time_to_target_s"), "not reached"), cost(r, "time_to_target_s"),
                      number(r.get("steps_redone")), number(r.get("restarts")),
                      f"{seconds(r['down_s'])} ({seconds(r['down_s'] / r['kills'])} each)" if r.get("kills")
                      else "-",
                      percent(r.get("final_accuracy")), number(r.get("hosts_at_end")),
                      "yes" if r.get("clean_exit") else "no"])
    also_level = f"time to {settings.get('also_target', 0.95):.0%}"
    return peer_line(settings, rows) + table(["strategy", "job", "failures", also_level, "vs no failures",
                                              f"time to {target:.0%}", "vs no failures", "steps re-done", "restarts",
                                              "time down", "final accuracy", "hosts at the end", "clean exit"], cells)


def render_downtime(name: str) -> str:
    """Each failure's recovery, step by step (a run with ``--timeline``): when each step was reached
    after the kill, and what it took since the one before; and, where the run recorded them, the
    rendezvous rounds the job re-formed in (:func:`rounds_joined`: one, or two when a replacement came
    after the survivors' round closed)."""
    data = load(name) or {}
    runs = [(row, i, parts) for row in data.get("rows", [])
            for i, parts in enumerate(row.get("downtime_parts") or [])]
    steps = [s for s in [*[part for part, _ in AGENT_STEPS], *WORKER_STEPS, "first step recorded"]
             if any(parts.get(s) is not None for _, _, parts in runs)]   # a run without the step's mark: none
    with_rounds = any(row.get("rounds_after_kill") for row, _, _ in runs)
    cells = []
    for row, i, parts in runs:
        reached = sorted(((parts[s], s) for s in steps if parts.get(s) is not None))
        since = {s: t - before for (before, _), (t, s) in zip([(0.0, "")] + reached, reached)}
        rounds = (row.get("rounds_after_kill") or [])[i:i + 1]
        said = ", then ".join(f"{r['world']} (hosts {', '.join(map(str, r['hosts']))}) at {r['at']:.2f} s"
                              for r in (rounds[0] if rounds else [])) or "-"
        cells.append([run_label(row), number(i + 1),
                      *[f"{parts[s]:.2f} s (+{since[s]:.2f})" if s in since else "-" for s in steps],
                      *([said] if with_rounds else [])])
    return table(["strategy", "failure", *steps, *(["world re-formed (its hosts), when"] if with_rounds else [])],
                 cells)


BLOCKS = (
    Block("train_through_failures_timeline", "A failure's downtime, step by step: vgg_fc, 3 hosts at 100 Mbit, one "
          "killed", ("train_through_failures_vgg_fc_100mbit_recovery_probe",),
          "nothing: each step's time after the kill (the latest agent or rank to reach it) and since the step before",
          partial(render_downtime, "train_through_failures_vgg_fc_100mbit_recovery_probe"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --hosts 3 --batch-size 20 "
                "--steps 70 --kill-every 30 --max-failures 1 --strategies blocktopk convoy-powersgd --failures-only "
                "--timeline --tag recovery_probe", emulated=True),
    Block("train_through_failures", "Training through failures: vgg_fc, 4 hosts at 100 Mbit, a host killed every "
          "80 steps", ("train_through_failures_vgg_fc_100mbit",),
          "torch DDP + torch's PowerSGD hook (at the rank named above the table) with a DCP checkpoint every 20 "
          "steps, restarted by torchrun on the full world (the lost host replaced at once), in the same run; and "
          "each strategy without failures",
          partial(render_train_through_failures, "train_through_failures_vgg_fc_100mbit"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80 "
                "--convoy-replaced --timeline", emulated=True),
    Block("train_through_failures_checkpoint_auto", "Training through failures with convoy checkpointing as "
          "often as its budget allows", ("train_through_failures_vgg_fc_100mbit_checkpoint_auto",),
          "torch DDP + torch's PowerSGD hook (at the rank named above the table) with a DCP checkpoint every 20 "
          "steps, restarted by torchrun on the full world, in the same run; and each strategy without failures",
          partial(render_train_through_failures, "train_through_failures_vgg_fc_100mbit_checkpoint_auto"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80 "
                "--strategies blocktopk convoy-powersgd tuned-peer --convoy-checkpoint-every auto --convoy-replaced "
                "--timeline --tag checkpoint_auto",
          emulated=True),
    Block("train_through_failures_peer_elastic", "Training through failures without a spare: convoy against DDP "
          "under torchrun elastic", ("train_through_failures_vgg_fc_100mbit_peer_elastic",),
          "torch DDP + torch's PowerSGD hook (at the rank named above the table) with a DCP checkpoint every 20 "
          "steps, in the same run: restarted by torchrun on the full world with a spare host at once, and "
          "re-formed on the survivors by torchrun --nnodes 1:4 (elastic, its workers' batch unchanged); and "
          "each strategy without failures",
          partial(render_train_through_failures, "train_through_failures_vgg_fc_100mbit_peer_elastic"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80 "
                "--strategies convoy-powersgd tuned-peer --convoy-checkpoint-every auto --peer-elastic --timeline "
                "--tag peer_elastic", emulated=True),
    Block("train_through_failures_downtime", "Each failure's downtime, step by step, in the 4-host run above",
          ("train_through_failures_vgg_fc_100mbit",),
          "nothing: each step's time after the kill (the latest agent or rank to reach it) and since the step "
          "before; the peer's workers mark no steps of their own",
          partial(render_downtime, "train_through_failures_vgg_fc_100mbit"),
          rerun="flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80 "
                "--convoy-replaced --timeline", emulated=True),
)


if __name__ == "__main__":
    main()
