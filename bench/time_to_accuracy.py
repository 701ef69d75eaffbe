"""Time to a test accuracy for several strategies on an emulated cluster with shaped links.

    python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --target 0.97 \\
        --strategies dense ddp powersgd topk blocktopk convoy-powersgd

Each strategy is one `convoy bench cluster` run (network namespaces + tbf; root
needed; `--rate loopback` runs local processes instead) that stops at the
target accuracy or after --steps. Reports per
strategy the wall time and step at which the target was first reached, the
median step time and bytes sent per step, and writes
bench/results/time_to_accuracy_<model>_<rate>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, launcher, run_stopping, save, stop_on_sigterm  # noqa: E402
from bench.figures import Block, load, loaded, number, percent, rows_of, seconds, table, times  # noqa: E402
from convoy.sim.catalog import PEER_POWERSGD_RANKS  # noqa: E402
from convoy.utils.lifetime import STOP_GRACE_S  # noqa: E402

PEER = str(Path(__file__).resolve().parent / "peers" / "ddp_train.py")
TWO_RACKS = str(Path(__file__).resolve().parent / "two_racks.toml")
# Stands for --shard-weights links: and the cluster's link rates (shares fitted to the links).
LINK_SHARES = "<link shares>"
# Stands for a tenth of --steps: torch's PowerSGD docs advise dense steps for the first 10% of training.
TENTH_OF_STEPS = "<10% of steps>"
# The peers a DDP user would tune among: torch's PowerSGD hook over a sweep of ranks, with and without
# the advised dense warm-up, and DDP's fp16 hook. Each run compares every row against the best of these.
TUNED_PEERS: dict[str, list[str]] = {
    **{f"ddp-powersgd-r{rank}": [PEER, "--powersgd-rank", str(rank)] for rank in PEER_POWERSGD_RANKS},
    "ddp-powersgd-r4-warm10": [PEER, "--powersgd-rank", "4", "--powersgd-start", TENTH_OF_STEPS],
    "ddp-fp16": [PEER, "--fp16-hook"],
}
# How long a run stopped at its time limit may take to stop: its ranks' grace, then the namespaces' teardown.
STOP_WAIT_S = 2 * STOP_GRACE_S
# The same ranks with no exchange at all: the step every strategy's is read against.
FLOOR = "no-exchange"

# name -> how the ranks are started (after `convoy bench cluster ... --`).
STRATEGIES: dict[str, list[str]] = {
    "dense": ["train"],
    "fp16": ["train", "--compress", "fp16"],
    "topk": ["train", "--compress", "topk"],
    "blocktopk": ["train", "--compress", "blocktopk", "--block-fraction", "0.01"],
    "convoy-powersgd": ["train", "--compress", "powersgd", "--powersgd-rank", "2"],   # as earlier results ran it
    "convoy-powersgd-r4": ["train", "--compress", "powersgd", "--powersgd-rank", "4"],
    "convoy-powersgd-r8": ["train", "--compress", "powersgd", "--powersgd-rank", "8"],
    "convoy-powersgd-r16": ["train", "--compress", "powersgd", "--powersgd-rank", "16"],
    "blocktopk-10%": ["train", "--compress", "blocktopk", "--block-fraction", "0.1"],
    "blocktopk-global": ["train", "--compress", "blocktopk", "--block-fraction", "0.01",
                         "--block-selection", "global"],
    "hybrid-3+1": ["train", "--parallel", "hybrid", "--conv-workers", "3", "--fc-workers", "1"],
    "hybrid-2+2": ["train", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "2"],
    "hierarchical": ["train", "--sync", "hierarchical", "--clusters", "2", "--exchange-every", "4",
                     "--node-profile", TWO_RACKS],
    "ps-fifo": ["train", "--sync", "ps", "--servers", "1", "--priority", "fifo"],
    "ps-graph": ["train", "--sync", "ps", "--servers", "1", "--priority", "graph"],
    # Every host serves a shard of the parameters and trains (BytePS's colocated servers).
    "ps-colocated": ["train", "--sync", "ps", "--servers", "colocated", "--priority", "graph"],
    "ps-colocated-fifo": ["train", "--sync", "ps", "--servers", "colocated", "--priority", "fifo"],
    # Bounded staleness (the forward of step t on the parameters of step t - 2), for the straggler bench.
    "ps-colocated-s2": ["train", "--sync", "ps", "--servers", "colocated", "--staleness", "2"],
    # Shares of the parameters fitted to the hosts' links (a host on a slow link serves almost nothing).
    "ps-colocated-by-link": ["train", "--sync", "ps", "--servers", "colocated", "--shard-weights", LINK_SHARES],
    "ps-colocated-s2-by-link": ["train", "--sync", "ps", "--servers", "colocated", "--staleness", "2",
                                "--shard-weights", LINK_SHARES],
    "ddp": [PEER],
    "powersgd": [PEER, "--powersgd-rank", "2"],   # the untuned peer of earlier results
    **TUNED_PEERS,
    FLOOR: [PEER, "--no-exchange"],
}
# convoy's own PowerSGD ranks, swept as the peer's are: its default and the next rank up, which reached
# 97% in fewer steps across seeds on vgg_fc (docs/compression.md).
CONVOY_POWERSGD_SWEEP = ("convoy-powersgd-r4", "convoy-powersgd-r8")
# What a run without --strategies compares: the floor, the tuned peers and convoy's compressed strategies.
DEFAULT_STRATEGIES = [FLOOR, *TUNED_PEERS, "dense", *CONVOY_POWERSGD_SWEEP, "blocktopk", "fp16"]


def tuned_peer_rank(model: str, rate: str) -> tuple[int, str]:
    """The PowerSGD rank of the DDP + PowerSGD hook peer that reached the target soonest in
    bench/time_to_accuracy.py's sweep of tuned peers for ``model`` at ``rate`` (its result file, the
    one place the tuning is recorded), and why, in words.

    Raises:
        ValueError: no such result, or no PowerSGD peer in it reached its target.

    Example::

        >>> tuned_peer_rank("vgg_fc", "100mbit")
        (4, 'ddp-powersgd-r4: the soonest of DDP + PowerSGD at ranks 1, 2, 4, 8, 16 to 97% (62.2 s) in ...')
    """
    name = f"time_to_accuracy_{model}_{rate}"
    data = load(name)
    if data is None:
        raise ValueError(f"no bench/results/{name}.json: run bench/time_to_accuracy.py --model {model} --rate {rate} "
                         "(its tuned peers)")
    # Plain PowerSGD peers only: a warm-up or the fp16 hook is another peer, not a rank of this one.
    swept = {f"ddp-powersgd-r{rank}": rank for rank in PEER_POWERSGD_RANKS}
    ranks = {row["strategy"]: swept[row["strategy"]] for row in data["rows"] if row["strategy"] in swept}
    timed = [(row["time_to_target_s"], row["strategy"]) for row in data["rows"]
             if row["strategy"] in ranks and row.get("time_to_target_s")]
    if not timed:
        raise ValueError(f"bench/results/{name}.json: no DDP + PowerSGD peer reached its target")
    seconds_, best = min(timed)
    target = data["settings"].get("target", 0.97)
    tried = ", ".join(str(r) for r in sorted(ranks.values()))
    return ranks[best], (f"{best}: the soonest of DDP + PowerSGD at ranks {tried} to {target:.0%} "
                         f"({seconds_:.1f} s) in bench/results/{name}.json")


def strategy_command(name: str, args: argparse.Namespace, out: Path, words: list[str] | None = None) -> list[str]:
    """Strategy ``name``'s command (``train ...`` or ``SCRIPT.py ...``) with the run's flags (``args``:
    model, lr, batch_size, steps, eval_every, target, warmup_steps, hosts, cluster) and run folder ``out``;
    ``words``: the strategy's own words when it is none of :data:`STRATEGIES` (default: its entry there)."""
    words = STRATEGIES[name] if words is None else words
    common = ["--model", args.model, "--lr", str(args.lr), "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--stop-at-accuracy", str(args.target), "--out", str(out)]
    own = ["--no-progress"] if words[0] == "train" else []
    if own and args.warmup_steps is not None:
        own += ["--warmup-steps", str(args.warmup_steps)]
    placeholders = {LINK_SHARES: lambda: link_shares(args), TENTH_OF_STEPS: lambda: str(max(2, args.steps // 10))}
    return [placeholders[word]() if word in placeholders else word for word in words] + common + own


def run_strategy(name: str, args: argparse.Namespace, out: Path, time_limit_s: float | None = None) -> dict:
    """One strategy's run on a fresh emulated cluster: its time to target, step time, bytes and curve.

    ``time_limit_s``: stop the run (SIGTERM to its launcher, which stops every rank) once it has taken this
    long, launch included, without reaching the target; the row then says so in ``time_limit_s``.
    """
    command = strategy_command(name, args, out)
    status, stderr, limited = run_stopping(launcher(command, args.hosts, args.rate, args.cluster), time_limit_s,
                                           STOP_WAIT_S)
    if status != 0 and not limited:
        raise RuntimeError(f"{name} failed:\n{stderr[-3000:]}")
    evals = [r for r in _records(out / "metrics-rank0.jsonl") if r["kind"] == "eval"]
    hit = next((e for e in evals if e["test_accuracy"] >= args.target), None)
    return {"strategy": name, "time_to_target_s": hit["time"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "final_accuracy": evals[-1]["test_accuracy"] if evals else None,
            "time_limit_s": time_limit_s if limited else None,
            # Steps of a given warm-up are left out of the steady step; a sparse
            # compressor's default ramp is counted (its bytes are part of the run).
            **step_figures(out, skip=1 + (args.warmup_steps or 0 if STRATEGIES[name][0] == "train" else 0)),
            "curve": [(e["time"], e["test_accuracy"]) for e in evals]}


def compare(rows: list[dict], also: str, also_suffix: str) -> None:
    """Add each row's ratios: to dense, to the best tuned peer (named in ``best_peer``) and to the floor.

    The best peer is the one that reaches the target soonest (at the other target, its own best);
    a ratio is the peer's time over the row's, so above 1 means the row is sooner.
    """
    by = {row["strategy"]: row for row in rows}
    floor = by.get(FLOOR, {}).get("step_s")
    peers = [row for row in rows if row["strategy"] in TUNED_PEERS]
    for key, suffix in (("time_to_target_s", ""), (also, also_suffix)):
        reached = [row for row in peers if row.get(key)]
        best = min(reached, key=lambda row: row[key]) if reached else None
        for row in rows:
            t = row.get(key)
            row[f"speedup_vs_best_peer{suffix}"] = best[key] / t if best and t else None
            row[f"best_peer{suffix}"] = best["strategy"] if best else None
    dense = by.get("dense", {}).get("time_to_target_s")
    for row in rows:
        t = row.get("time_to_target_s")
        row["speedup_vs_dense"] = dense / t if dense and t else None
        row["step_vs_floor"] = row["step_s"] / floor if floor and row.get("step_s") else None


def step_figures(out: Path, skip: int = 1) -> dict:
    """``step_s`` and ``MB_sent/step`` of a run folder's metrics, after ``skip`` warm-up steps.

    A rank's ``wall_s`` intervals tile its run (end of one backward to the next), so
    their mean is the period of the job; their median would hide a periodic step
    (hierarchical's exchange every T batches), and the busiest rank per step only
    adds jitter. Steps that follow an evaluation carry its time and are left out;
    the rest are taken in whole periods of 4 steps (a multiple of every T the
    benchmarks use). Bytes are averaged over all ranks (in hybrid and ps, roles
    send different amounts) and count what a rank sends beside its engine (hybrid's
    link, a colocated rank's server).
    """
    ranks = [_records(path) for path in sorted(out.glob("metrics-rank*.jsonl"))]
    after_eval = {r["step"] for r in ranks[0] if r["kind"] == "eval"}
    means, sent = [], []
    for records in ranks:
        steps = [r for r in records if r["kind"] == "step"][skip:]
        if not steps:
            continue
        whole = steps[:len(steps) // 4 * 4] or steps
        means.append(statistics.mean(r["wall_s"] for r in whole if r["step"] not in after_eval))
        sent.append(statistics.mean(r["bytes_sent"] + r.get("link_bytes_sent", 0) + r.get("server_bytes_sent", 0)
                                    for r in steps))
    if not means:   # stopped (at a time limit) before its warm-up was over
        return {"step_s": None, "MB_sent/step": None}
    return {"step_s": statistics.mean(means), "MB_sent/step": statistics.mean(sent) / 1e6}


def link_shares(args: argparse.Namespace) -> str:
    """``--shard-weights`` for the hosts of ``args.cluster``: ``links:`` and their rates (equal links without one)."""
    from convoy.sim.cluster import load_cluster

    cluster = load_cluster(args.cluster) if args.cluster else None
    rates = (cluster.rates or [cluster.rate_bps] * cluster.nodes) if cluster else [1e9] * args.hosts
    return "links:" + ",".join(f"{int(rate)}bit" for rate in rates)


def _records(path: Path) -> list[dict]:
    # A rank stopped at a time limit may have left its last line unfinished.
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]


def plot_curves(rows: list[dict], path: Path, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        times, accs = zip(*row["curve"])
        ax.plot(times, [100 * a for a in accs], marker="o", markersize=3, label=row["strategy"])
    ax.axhline(100 * target, color="grey", linestyle=":")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each host's link, e.g. 100mbit, 1gbit; loopback: "
                        "local processes, no emulated cluster")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400, help="give up after this many steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--also-target", type=float, default=0.95,
                        help="also report the time to this accuracy (from the same runs' curves)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="convoy's compressors warm up over "
                        "the first N steps (default: convoy train's own default)")
    parser.add_argument("--cluster", help="a cluster file for convoy bench cluster --cluster (it replaces --hosts "
                        "and --rate), e.g. bench/straggler.toml: one host at a quarter of the others' speed")
    parser.add_argument("--tag", help="suffix of the result files' names, to keep several runs apart")
    parser.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES, choices=list(STRATEGIES),
                        help=f"default: {' '.join(DEFAULT_STRATEGIES)}")
    args = parser.parse_args()
    stop_on_sigterm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.strategies:
            try:
                rows.append(run_strategy(name, args, Path(tmp, name)))
            except RuntimeError as exc:   # one failing strategy must not lose the others' figures
                print(exc, file=sys.stderr, flush=True)
                rows.append({"strategy": name, "error": str(exc).splitlines()[-1], "curve": [],
                             "time_to_target_s": None})
            print({k: v for k, v in rows[-1].items() if k != "curve"}, flush=True)
    also = f"time_to_{args.also_target:g}_s"
    for row in rows:
        row[also] = next((time for time, accuracy in row["curve"] if accuracy >= args.also_target), None)
    compare(rows, also, f"_{args.also_target:g}")
    # A cluster file names its hosts' links (they may differ), so it names the results.
    links = Path(args.cluster).stem if args.cluster else args.rate
    name = f"time_to_accuracy_{args.model}_{links}" + (f"_{args.tag}" if args.tag else "")
    save(name, vars(args), rows, ["strategy", "time_to_target_s", "steps_to_target", "speedup_vs_dense",
                                  "speedup_vs_best_peer", also, f"speedup_vs_best_peer_{args.also_target:g}",
                                  "final_accuracy", "step_s", "step_vs_floor", "MB_sent/step", "error"])
    plot_curves([r for r in rows if r["curve"]], RESULTS / f"{name}.png", args.target)
    print(verdict(rows, args.target, args.also_target))


def verdict(rows: list[dict], target: float, also_target: float) -> str:
    """One line per target: convoy's soonest strategy against the best tuned peer of the run."""
    lines = []
    for key, suffix, level in (("time_to_target_s", "", target), (f"time_to_{also_target:g}_s",
                                                                 f"_{also_target:g}", also_target)):
        own = [r for r in rows if r.get(key) and STRATEGIES[r["strategy"]][0] == "train"]
        best = min(own, key=lambda r: r[key]) if own else None
        peer = rows[0].get(f"best_peer{suffix}") if rows else None
        lines.append(f"{level:.0%}: convoy's soonest {best['strategy'] if best else 'none'}"
                     f"{f' at {best[key]:.1f} s' if best else ''}; best tuned peer {peer or 'none reached it'}"
                     + (f"; {best[f'speedup_vs_best_peer{suffix}']:.2f}x sooner" if best and peer else ""))
    return "\n".join(lines)


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_engine_vs_ddp_cluster() -> str:
    cells = []
    for rate in ("1gbit", "100mbit"):
        by = {r["strategy"]: r for r in rows_of(f"engine_vs_ddp_cluster_{rate}")}
        if "dense" in by and "ddp" in by:
            cells.append([rate, seconds(by["dense"]["step_s"]), seconds(by["ddp"]["step_s"]),
                          number(by["dense"]["step_s"] / by["ddp"]["step_s"])])
    return table(["links", "engine step", "DDP step", "engine / DDP"], cells)


def render_time_to_accuracy(*names: str, reference: str | None = None) -> str:
    """Rows of time_to_accuracy files; ``reference`` supplies the dense row where a file has none."""
    cells = []
    for data in loaded(*names):
        rows = data["rows"]
        dense = next((r for r in rows + (rows_of(reference) if reference else []) if r["strategy"] == "dense"),
                     None)
        for r in rows:
            hit = r.get("time_to_target_s")
            links = data["settings"].get("cluster") or data["settings"].get("rate", "-")
            cells.append([links, r["strategy"],
                          seconds(hit, "not reached") if "error" not in r else f"failed: {r['error']}",
                          number(r.get("steps_to_target")),
                          times(dense["time_to_target_s"] / hit)
                          if dense and dense.get("time_to_target_s") and hit else "-",
                          percent(r.get("final_accuracy")), seconds(r.get("step_s")),
                          number(r.get("MB_sent/step"))])
    return table(["links", "strategy", "time to 97%", "steps", "vs convoy all-reduce", "best accuracy", "step",
                  "MB / step / worker"], cells)


def render_tuned_peers(name: str) -> str:
    """A run of the default strategies: each row's times to 95% and the target against the best tuned
    peer of the run (the one that got there soonest), and its step as a multiple of the no-exchange floor."""
    rows = rows_of(name)

    def against(r: dict, key: str, suffix: str) -> str:
        if not r.get(key):
            return "-"
        return f"{times(r[f'speedup_vs_best_peer{suffix}'])} ({r[f'best_peer{suffix}']})" \
            if r.get(f"speedup_vs_best_peer{suffix}") else "-"
    cells = [[r["strategy"], seconds(r.get("time_to_0.95_s"), "not reached"), against(r, "time_to_0.95_s", "_0.95"),
              seconds(r.get("time_to_target_s"), "not reached"), against(r, "time_to_target_s", ""),
              number(r.get("steps_to_target")), percent(r.get("final_accuracy")), seconds(r.get("step_s")),
              times(r["step_vs_floor"]) if r.get("step_vs_floor") else "-", number(r.get("MB_sent/step"))]
             for r in rows]
    return table(["strategy", "time to 95%", "best peer's / this", "time to 97%", "best peer's / this", "steps",
                  "best accuracy", "step", "step / floor", "MB / step / worker"], cells)


def render_versus_peer(*names: str, peer: str = "powersgd") -> str:
    """Rows of time_to_accuracy runs, each against its own run's ``peer`` row: times to 95% and to the
    target, and the peer's time over each (a peer that never got there within its steps is named)."""
    cells = []
    for run, name in enumerate(names, 1):
        rows = (load(name) or {}).get("rows", [])
        mine = next((r for r in rows if r["strategy"] == peer), {})

        def ratio(row: dict, key: str) -> str:
            if row is mine or not row.get(key):
                return "-"
            return times(mine[key] / row[key]) if mine.get(key) else "peer not reached"
        cells += [[*([str(run)] if len(names) > 1 else []), r["strategy"],
                   seconds(r.get("time_to_0.95_s"), "not reached"), ratio(r, "time_to_0.95_s"),
                   seconds(r.get("time_to_target_s"), "not reached") if "error" not in r
                   else f"failed: {r['error']}", ratio(r, "time_to_target_s"),
                   percent(r.get("final_accuracy")), seconds(r.get("step_s")), number(r.get("MB_sent/step"))]
                  for r in rows]
    return table([*(["run"] if len(names) > 1 else []), "strategy", "time to 95%", f"vs {peer}",
                  "time to 97%", f"vs {peer}", "best accuracy", "step", "MB / step / worker"], cells)


def render_ps_steps(*names: str, versus: str = "graph step", sent: str = "MB sent / step / rank") -> str:
    """Step time of colocated servers against convoy's ring all-reduce and against the ps-colocated row
    (graph priority, equal shares) of the same run; ``sent`` heads the bytes column (results measured
    before the metrics counted a colocated rank's server hold its pushes only)."""
    cells = []
    for data in loaded(*names):
        steps = {r["strategy"]: r.get("step_s") for r in data["rows"]}
        for r in data["rows"]:
            step = r.get("step_s")
            cells.append([data["settings"]["model"], r["strategy"], seconds(step),
                          times(step / steps["dense"]) if step and steps.get("dense") else "-",
                          times(step / steps["ps-colocated"]) if step and steps.get("ps-colocated") else "-",
                          number(r.get("MB_sent/step"))])
    return table(["model", "strategy", "step", "step / all-reduce step", f"step / {versus}", sent], cells)


TTA = ("python bench/time_to_accuracy.py --model vgg_fc --lr 0.02 --batch-size 16 --steps 400 "
       "--eval-every 25 --warmup-steps 20 --rate 100mbit")
PS_COLOCATED = ("time_to_accuracy_vgg_fc_100mbit_ps", "time_to_accuracy_resnet18_100mbit_ps")
VERSUS_POWERSGD = ("DDP + torch's PowerSGD hook (rank 2) in the same run (powersgd; the ratios are its time over each "
                   "row's)")
RESNET18_RUNS = ("time_to_accuracy_resnet18_100mbit_vs_ddp_powersgd",
                 "time_to_accuracy_resnet18_100mbit_vs_ddp_powersgd_fp16",
                 "time_to_accuracy_resnet18_100mbit_vs_ddp_powersgd_fp16_fresh_clone",
                 "time_to_accuracy_resnet18_100mbit_vs_ddp_powersgd_blocktopk_l2")


def _versus_powersgd(name: str, title: str, result: str, flags: str) -> Block:
    """A block of one run's rows against DDP + PowerSGD in that run, measured by this script with ``flags``."""
    return Block(name, title, (result,), VERSUS_POWERSGD, partial(render_versus_peer, result),
                 rerun=f"python bench/time_to_accuracy.py {flags}", emulated=True)


def _tuned(model: str, flags: str, tag: str = "", title: str = "against the tuned peers") -> Block:
    """A block of one default run (the tuned peers, the floor, convoy's strategies) of ``model`` at 100 Mbit,
    or of a run of some of them (``tag``: its --tag)."""
    result = f"time_to_accuracy_{model}_100mbit" + (f"_{tag}" if tag else "")
    return Block(f"tta_{model}_100mbit_{tag or 'tuned'}", f"Time to 95% and 97%: {model}, 4 hosts at 100 Mbit, {title}",
                 (result,), "the best of the run's tuned peers: DDP + torch's PowerSGD hook at each rank of its rows"
                 + ("" if tag else " (and rank 4 with 10% dense warm-up) and DDP's fp16 hook") + "; no-exchange is the floor",
                 partial(render_tuned_peers, result), rerun=f"python bench/time_to_accuracy.py {flags}", emulated=True)


BLOCKS = (
    _tuned("vgg_fc", "--hosts 4 --rate 100mbit --model vgg_fc --target 0.97"),
    _tuned("resnet18", "--hosts 4 --rate 100mbit --model resnet18 --target 0.97 --eval-every 25"),
    _tuned("resnet18", "--hosts 4 --rate 100mbit --model resnet18 --target 0.97 --eval-every 25 --strategies "
           "no-exchange ddp-powersgd-r4 ddp-powersgd-r8 ddp-powersgd-r16 convoy-powersgd-r4 convoy-powersgd-r8 "
           "--tag powersgd_ranks", tag="powersgd_ranks", title="the PowerSGD hook and convoy's PowerSGD at their best ranks"),
    _tuned("resnet18", "--hosts 4 --rate 100mbit --model resnet18 --target 0.97 --eval-every 25 --strategies "
           "ddp-powersgd-r8 ddp-powersgd-r16 convoy-powersgd-r16 --tag convoy_r16", tag="convoy_r16",
           title="convoy's PowerSGD at rank 16 against the hook's best ranks"),
    Block("tta_resnet18_100mbit_r8", "Time to 95% and 97%: resnet18, convoy's PowerSGD at the best peer's rank",
          ("time_to_accuracy_resnet18_100mbit_convoy_r8",), "DDP + torch's PowerSGD hook at rank 8 (the best tuned "
          "peer of the resnet18 run above) in the same run (the ratios are its time over each row's)",
          partial(render_versus_peer, "time_to_accuracy_resnet18_100mbit_convoy_r8", peer="ddp-powersgd-r8"),
          rerun="python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model resnet18 --target 0.97 "
                "--eval-every 25 --strategies ddp-powersgd-r8 convoy-powersgd-r8 --tag convoy_r8", emulated=True),
    Block("engine_vs_ddp_cluster", "Engine against torch DDP, 4 emulated hosts",
          ("engine_vs_ddp_cluster_1gbit", "engine_vs_ddp_cluster_100mbit"), "torch DDP", render_engine_vs_ddp_cluster,
          rerun="python bench/time_to_accuracy.py --strategies dense ddp --rate 1gbit|100mbit", emulated=True),
    Block("tta_vgg_fc_100mbit", "Time to 97%: compressors, vgg_fc, 4 hosts at 100 Mbit",
          ("time_to_accuracy_vgg_fc_100mbit_untuned_peers", "time_to_accuracy_vgg_fc_100mbit_powersgd"),
          "torch DDP and DDP + PowerSGD (rank 2), same data order",
          partial(render_time_to_accuracy, "time_to_accuracy_vgg_fc_100mbit_untuned_peers",
                  "time_to_accuracy_vgg_fc_100mbit_powersgd", reference="time_to_accuracy_vgg_fc_100mbit_untuned_peers"),
          rerun=f"{TTA} (PowerSGD again with --tag powersgd --strategies powersgd)", emulated=True),
    Block("tta_vgg_fc_100mbit_sparse", "Time to 97%: sparse blocktopk 1% with DGC's corrections",
          ("time_to_accuracy_vgg_fc_100mbit_sparse",), "DDP + PowerSGD (rank 2); dense from the 100 Mbit run above",
          partial(render_time_to_accuracy, "time_to_accuracy_vgg_fc_100mbit_sparse",
                  reference="time_to_accuracy_vgg_fc_100mbit_untuned_peers"),
          rerun="python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --target 0.97 "
                "--strategies powersgd blocktopk --tag sparse", emulated=True),
    _versus_powersgd("tta_vgg_fc_100mbit_powersgd_engine", "Time to 95% and 97%: convoy's compressors against DDP + "
                     "PowerSGD", "time_to_accuracy_vgg_fc_100mbit_vs_ddp_powersgd",
                     "--hosts 4 --rate 100mbit --model vgg_fc --target 0.97 --tag vs_ddp_powersgd --strategies powersgd "
                     "convoy-powersgd blocktopk"),
    Block("tta_resnet18_100mbit_peer", "Time to 95% and 97%: resnet18, convoy's compressors against DDP + PowerSGD",
          RESNET18_RUNS,
          "DDP + torch's PowerSGD hook (rank 2), in each run (the ratios are its time in that run over each row's)",
          partial(render_versus_peer, *RESNET18_RUNS),
          rerun="python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model resnet18 --target 0.97 "
                "--eval-every 25 --tag vs_ddp_powersgd --strategies powersgd convoy-powersgd blocktopk fp16 (run 1); "
                "--tag vs_ddp_powersgd_fp16 --strategies powersgd fp16 (run 2); --tag "
                "vs_ddp_powersgd_fp16_fresh_clone --strategies powersgd fp16 (run 3, a fresh clone); without "
                "--eval-every (20), --tag vs_ddp_powersgd_blocktopk_l2 --strategies powersgd blocktopk (run 4, "
                "blocktopk scoring blocks by L2)", emulated=True),
    _versus_powersgd("tta_vgg_fc_1gbit_peer", "Time to 95% and 97% at 1 Gbit: vgg_fc, convoy against DDP + PowerSGD",
                     "time_to_accuracy_vgg_fc_1gbit", "--hosts 4 --rate 1gbit --model vgg_fc --target 0.97 "
                     "--strategies powersgd convoy-powersgd blocktopk dense"),
    _versus_powersgd("tta_resnet18_1gbit_peer", "Time to 95% and 97% at 1 Gbit: resnet18, convoy against DDP + "
                     "PowerSGD", "time_to_accuracy_resnet18_1gbit", "--hosts 4 --rate 1gbit --model resnet18 "
                     "--target 0.97 --eval-every 25 --strategies powersgd convoy-powersgd blocktopk fp16"),
    Block("tta_vgg_fc_straggler", "Time to 97%: vgg_fc, 4 hosts at 100 Mbit, one at a quarter of the others' speed",
          ("time_to_accuracy_vgg_fc_straggler",), "convoy's all-reduce (dense) in the same run; ps-colocated-s2 is "
          "--staleness 2", partial(render_time_to_accuracy, "time_to_accuracy_vgg_fc_straggler"),
          rerun="python bench/time_to_accuracy.py --model vgg_fc --target 0.97 --cluster bench/straggler.toml "
                "--strategies dense ps-colocated ps-colocated-s2", emulated=True),
    Block("tta_vgg_fc_slow_link", "Time to 97%: vgg_fc, 3 hosts at 200 Mbit and one at 50 Mbit",
          ("time_to_accuracy_vgg_fc_slow_link",), "convoy's all-reduce (dense) in the same run; "
          "ps-colocated-by-link is --shard-weights from the links",
          partial(render_time_to_accuracy, "time_to_accuracy_vgg_fc_slow_link"),
          rerun="python bench/time_to_accuracy.py --model vgg_fc --target 0.97 --cluster bench/slow_link.toml "
                "--strategies dense ps-colocated-by-link", emulated=True),
    Block("ps_slow_link_steps", "Colocated servers' step with one host on a slower link",
          ("time_to_accuracy_vgg_fc_slow_link_steps",),
          "convoy's ring all-reduce (dense) and the servers on equal shares (ps-colocated), in the same run",
          partial(render_ps_steps, "time_to_accuracy_vgg_fc_slow_link_steps", versus="equal shares' step",
                  sent="MB sent / step / rank (ps: its pushes only)"),
          rerun="python bench/time_to_accuracy.py --model vgg_fc --steps 13 --eval-every 13 --target 0.999 "
                "--cluster bench/slow_link.toml --tag steps --strategies dense ps-colocated ps-colocated-by-link "
                "ps-colocated-s2-by-link", emulated=True),
    Block("tta_lenet_100mbit", "Time to 97%: lenet, 4 hosts at 100 Mbit", ("time_to_accuracy_lenet_100mbit",),
          "torch DDP and DDP + PowerSGD", partial(render_time_to_accuracy, "time_to_accuracy_lenet_100mbit"),
          rerun="python bench/time_to_accuracy.py --model lenet --lr 0.05 --batch-size 32 --steps 600 "
                "--eval-every 20 --rate 100mbit", emulated=True),
    Block("tta_vgg_fc_hybrid", "Time to 97%: hybrid, vgg_fc, 4 hosts at 100 Mbit and on loopback",
          ("time_to_accuracy_vgg_fc_100mbit_hybrid", "time_to_accuracy_vgg_fc_loopback"),
          "convoy data-parallel all-reduce (at 100 Mbit: its row in the compressors' run)",
          partial(render_time_to_accuracy, "time_to_accuracy_vgg_fc_100mbit_hybrid", "time_to_accuracy_vgg_fc_loopback",
                  reference="time_to_accuracy_vgg_fc_100mbit_untuned_peers"),
          rerun=f"{TTA.replace(' --warmup-steps 20', '')} --tag hybrid --strategies hybrid-3+1 hybrid-2+2; "
                "--rate loopback for 4 local processes", emulated=True),
    Block("ps_colocated", "Colocated parameter servers: step time, 4 hosts at 100 Mbit", PS_COLOCATED,
          "convoy's ring all-reduce (dense) and the same servers in arrival order (ps-colocated-fifo)",
          partial(render_ps_steps, *PS_COLOCATED),
          rerun="python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --steps 60 --eval-every 30 "
                "--target 0.999 --strategies dense ps-colocated ps-colocated-fifo --tag ps; the same with --model "
                "resnet18 --steps 20 --eval-every 20 --strategies ps-colocated ps-colocated-fifo", emulated=True),
)


if __name__ == "__main__":
    main()
