"""The simulator against every measurement under bench/results it knows how to read.

Profiles the models here (forward/backward per layer, one thread) and
predicts each measured setting:

* ``cluster_allreduce_*.json``: single gloo all-reduces on emulated hosts;
* ``engine_vs_ddp_cluster_*.json``, ``time_to_accuracy_*.json``,
  ``simulator_runs_*.json``, ``suite_*.json``: step times per strategy on emulated hosts
  (strategy names are those of ``bench/time_to_accuracy.py``'s table; rows
  with a ``flags`` list are read from it, so hierarchical and ps runs count
  as soon as they land);
* ``ps.json``, ``ps_full.json`` (bench/ps.py) and ``hierarchical.json`` (bench/hierarchical.py,
  two racks);
* ``engine_vs_ddp.json`` and ``hybrid.json``: 2-4 processes on loopback
  (``engine_vs_ddp.json`` fitted the CPU cost per byte: calibration rows);
* ``compression_wire_bytes.json``: bytes sent per step (exact, not timed).

A row of ``simulator_runs`` that saw other training jobs start (``other_jobs``),
or a group of runs whose dense all-reduce step is over 10% off the quiet
reference of the same setting (``engine_vs_ddp_cluster_<rate>.json``;
``engine_vs_ddp.json`` for loopback) was measured while other jobs shared the
2 cores: its rows are kind ``busy``, shown and summarised apart
(plan's check compares their order, which suffers less than their times).

Emulated hosts share this machine's cores, so every cluster is given
``cores = cpus / ranks`` from the file's ``machine`` record. Writes
bench/results/simulator_validation.{json,md}::

    python bench/simulator_validation.py [--reprofile]
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save  # noqa: E402
from bench.figures import Block, rows_of, seconds, table as markdown_table  # noqa: E402
from bench.time_to_accuracy import STRATEGIES  # noqa: E402
from convoy.emulation.topology import parse_rate  # noqa: E402
from convoy.sim.catalog import from_flags  # noqa: E402
from convoy.sim.cluster import Cluster  # noqa: E402
from convoy.sim.codec import Compression  # noqa: E402
from convoy.sim.cpu import CpuCosts, measure_cpu_costs  # noqa: E402
from convoy.sim.network import ring_allreduce  # noqa: E402
from convoy.sim.profile import ModelProfile, load_profile, profile_model  # noqa: E402
from convoy.sim.strategies import ClusterCycles, ConvFcSplit, LayerRing, Strategy, TorchDDP  # noqa: E402

# gloo over loopback on the 2-core machine: fast next to any shaped link.
LOOPBACK_BPS, LOOPBACK_LATENCY_S = 20e9, 20e-6
PROFILE_BATCH = 16


@dataclass
class Case:
    source: str
    model: str
    setting: str
    strategy: str
    measured: float
    predict: Callable[[], float]
    kind: str = "validation"
    unit: str = "s"
    runs: tuple[Strategy, Cluster, int] | None = None   # strategy, cluster, batch: for plan's check


@lru_cache(maxsize=None)
def profile(model: str) -> ModelProfile:
    """The model's profile, measured once and kept in bench/results/simulator_profile_<model>.json.

    Re-runs then predict from the same compute times; ``--reprofile`` measures again
    (do it on a quiet machine: other jobs' load inflates every layer's time).
    """
    path = RESULTS / f"simulator_profile_{model}.json"
    if path.exists() and "--reprofile" not in sys.argv:
        return load_profile(path)
    measured = profile_model(model, PROFILE_BATCH, repeats=8)
    path.write_text(json.dumps(measured.to_json(), indent=1))
    return measured


@lru_cache(maxsize=None)
def costs() -> CpuCosts:
    """This machine's CPU costs, measured once and kept in bench/results/simulator_cpu_costs.json."""
    path = RESULTS / "simulator_cpu_costs.json"
    if path.exists() and "--reprofile" not in sys.argv:
        return CpuCosts(**json.loads(path.read_text()))
    measured = measure_cpu_costs()
    path.write_text(json.dumps(measured.__dict__, indent=1))
    return measured


def step_time(strategy: Strategy, model: str, batch: int, cluster: Cluster) -> Callable[[], float]:
    return lambda: strategy.step_time(profile(model).at_batch(batch), cluster).step_s


# Ranks exchange while the others compute (backward runs beside the engine's
# exchanges), so a message waits for a receiver woken on a busy machine.
EXCHANGE_WHILE_BUSY = True


@lru_cache(maxsize=None)
def emulated_wake_s(busy: bool = EXCHANGE_WHILE_BUSY) -> float:
    """A receiver's per-message time on the emulated hosts: the smallest measured gloo all-reduce
    per step of its ring (its bytes take microseconds), the mean over the link rates measured;
    ``busy``: measured while every rank also computed (``bench/cluster_allreduce.py --busy``).
    0 without a measurement."""
    steps = []
    for path in sorted(RESULTS.glob("cluster_allreduce_*.json")):
        rows = [r for r in json.loads(path.read_text())["rows"] if bool(r.get("busy")) == busy]
        if rows:
            row = min(rows, key=lambda r: r["size_MB"])
            steps.append(row["allreduce_s"] / (2 * (int(row["hosts"]) - 1)))
    return statistics.mean(steps) if steps else 0.0


@lru_cache(maxsize=None)
def shared_core_efficiency(model: str) -> float:
    """How much of its share of the cores a rank of ``model`` gets when the emulated hosts share
    this machine: the profile's compute at ``cpus / hosts`` cores over the compute-only step
    bench/suite.py measured (one-process runs on every host at once, nothing exchanged), the
    mean over every suite file that measured the model. The profile is each layer's fastest of
    several one-thread runs; processes sharing a core also pay for switching, their caches, the
    training loop and data loading. 1 where the suite has not measured the model (at most 1)."""
    ratios = []
    for path in sorted(RESULTS.glob("suite_*.json")):
        data = json.loads(path.read_text())
        s, cpus = data["settings"], data["machine"]["cpus"]
        measured = next((r["compute_only_s"] for r in data["rows"] if r["model"] == model and r.get("compute_only_s")),
                        None)
        if measured:
            ideal = profile(model).at_batch(int(s["batch_size"])).compute_s * max(1.0, int(s["hosts"]) / cpus)
            ratios.append(ideal / measured)
    return min(1.0, statistics.mean(ratios)) if ratios else 1.0


def emulated(data: dict, model: str) -> Cluster:
    s = data["settings"]
    hosts = int(s.get("hosts", 4))
    inter = s.get("inter_rack_rate")
    return Cluster(hosts, parse_rate(s.get("rate", "100mbit")), int(s.get("racks", 1)),
                   parse_rate(inter) if inter else None, wake_s=emulated_wake_s(),
                   cores=data["machine"]["cpus"] / hosts * shared_core_efficiency(model))


def loopback(world: int, cpus: int) -> Cluster:
    return Cluster(world, LOOPBACK_BPS, latency_s=LOOPBACK_LATENCY_S, cores=cpus / world)


def reference_dense(model: str, rate: str | None) -> float | None:
    """The quiet dense all-reduce step of vgg_fc-style runs: 4 emulated hosts at ``rate``, batch 16
    (``engine_vs_ddp_cluster_<rate>.json``), or 4 processes on loopback (``engine_vs_ddp.json``)."""
    if rate is None:
        path = RESULTS / "engine_vs_ddp.json"
        rows = json.loads(path.read_text())["rows"] if path.exists() else []
        return next((r["engine_step_s"] for r in rows if r["model"] == model and r["world"] == 4), None)
    path = RESULTS / f"engine_vs_ddp_cluster_{rate}.json"
    if not path.exists():
        return None
    ref = json.loads(path.read_text())
    if ref["settings"].get("model") != model or ref["settings"].get("batch_size") != 16:
        return None
    return next((r["step_s"] for r in ref["rows"] if r["strategy"] == "dense"), None)


def busy(model: str, rate: str | None, dense_s: float | None, at_most: bool = False) -> bool:
    """Whether other jobs shared the machine during a group of runs: its dense all-reduce step
    (stable when bandwidth-bound) is over 10% off the quiet reference (``at_most``: over it,
    for a smaller batch than the reference's)."""
    ref = reference_dense(model, rate)
    if ref is None or dense_s is None:
        return False
    return dense_s > 1.1 * ref if at_most else abs(dense_s / ref - 1) > 0.10


def strategy_rows(path: Path, data: dict) -> Iterator[Case]:
    """Step times per strategy on emulated hosts (time-to-accuracy schema)."""
    s = data["settings"]
    on_loopback = s.get("rate") == "loopback"
    cluster = loopback(int(s.get("hosts", 4)), data["machine"]["cpus"]) if on_loopback else emulated(data, s["model"])
    dense = next((r["step_s"] for r in data["rows"] if r.get("strategy") == "dense" and r.get("step_s")), None)
    quiet_reference = path.name == f"engine_vs_ddp_cluster_{s.get('rate')}.json"
    kind = "busy" if not quiet_reference and s.get("batch_size") == 16 and \
        busy(s["model"], None if on_loopback else s.get("rate"), dense) else "validation"
    for row in data["rows"]:
        flags = row.get("flags") or STRATEGIES.get(row["strategy"])
        if flags is None or not row.get("step_s"):
            print(f"skipped {path.name}: {row['strategy']} (unknown strategy name)", file=sys.stderr)
            continue
        strategy, batch = from_flags(list(flags), cluster.nodes, costs()), int(s["batch_size"])
        yield Case(path.name, s["model"], f"{cluster.nodes} hosts, {s['rate']}, batch {batch}",
                   strategy.label, row["step_s"], step_time(strategy, s["model"], batch, cluster),
                   kind="busy" if row.get("other_jobs", 0) > 0 else kind, runs=(strategy, cluster, batch))


def suite_rows(path: Path, data: dict) -> Iterator[Case]:
    """bench/suite.py: the time-to-accuracy schema, one group of rows per model and link rate."""
    for model, rate in sorted({(r["model"], r["rate"]) for r in data["rows"]}):
        rows = [r for r in data["rows"] if (r["model"], r["rate"]) == (model, rate)]
        yield from strategy_rows(path, {**data, "settings": {**data["settings"], "model": model, "rate": rate},
                                        "rows": rows})


def ps_rows(path: Path, data: dict) -> Iterator[Case]:
    """bench/ps.py: 4 hosts (1 server, 3 workers), batch 16, one row per (model, rate, configuration)."""
    from bench import ps

    dense = {(r["model"], r["rate"]): r["step_s"] for r in data["rows"] if r["config"] == "allreduce"}
    for row in data["rows"]:
        cluster = emulated({"settings": {"hosts": ps.HOSTS, "rate": row["rate"]}, "machine": data["machine"]},
                           row["model"])
        flags = ps.CONFIGS.get(row["config"])
        if flags is None:
            print(f"skipped {path.name}: {row['config']} (unknown configuration)", file=sys.stderr)
            continue
        strategy = from_flags(flags, cluster.nodes, costs())
        kind = "busy" if busy(row["model"], row["rate"], dense.get((row["model"], row["rate"]))) else "validation"
        yield Case(path.name, row["model"], f"{ps.HOSTS} hosts, {row['rate']}, batch {ps.BATCH}", strategy.label,
                   row["step_s"], step_time(strategy, row["model"], ps.BATCH, cluster), kind=kind,
                   runs=(strategy, cluster, ps.BATCH))


def hierarchical_rows(path: Path, data: dict) -> Iterator[Case]:
    """bench/hierarchical.py: two racks; ``flat`` and ``hier T=t`` runs (torch's peer is not modelled)."""
    s = data["settings"]
    cluster = emulated({"settings": {**s, "racks": 2}, "machine": data["machine"]}, s["model"])   # fixed racks
    for row in data["rows"]:
        name = row["run"]
        if name == "flat":
            strategy = LayerRing(costs=costs())
        elif name.startswith("hier T="):
            strategy = ClusterCycles(2, int(name.split("=")[1]), costs())
        else:
            continue
        batch = int(s["batch_size"])
        yield Case(path.name, s["model"], f"{cluster.nodes} hosts in 2 racks, {s['rate']} / "
                   f"{s['inter_rack_rate']} between, batch {batch}", strategy.label, row["step_s"],
                   step_time(strategy, s["model"], batch, cluster), runs=(strategy, cluster, batch))


def allreduce_rows(path: Path, data: dict) -> Iterator[Case]:
    smallest = min(float(r["size_MB"]) for r in data["rows"])
    for row in data["rows"]:
        busy = bool(row.get("busy"))
        cluster = Cluster(int(row["hosts"]), parse_rate(row["rate"]), wake_s=emulated_wake_s(busy))
        size = float(row["size_MB"])
        yield Case(path.name, "-", f"{row['hosts']} hosts, {row['rate']}" + (", busy" if busy else ""),
                   f"gloo all-reduce {size:g} MB",
                   row["allreduce_s"], lambda size=size, c=cluster: ring_allreduce(size * 1e6, c.nodes, c.ring_link()),
                   kind="calibration" if size == smallest else "validation")


def loopback_rows(path: Path, data: dict) -> Iterator[Case]:
    cpus = data["machine"]["cpus"]
    for row in data["rows"]:
        cluster, batch = loopback(int(row["world"]), cpus), int(row["batch/worker"])
        setting = f"loopback, {row['world']} procs, batch {batch}"
        for key, strategy in (("engine_step_s", LayerRing(costs=costs())), ("ddp_step_s", TorchDDP(costs=costs()))):
            yield Case(path.name, row["model"], setting, strategy.label, row[key],
                       step_time(strategy, row["model"], batch, cluster), kind="calibration")


def hybrid_rows(path: Path, data: dict) -> Iterator[Case]:
    cpus = data["machine"]["cpus"]
    # Data-parallel at batch 12 can only be faster than engine_vs_ddp's 4 x 16.
    dense = {r["model"]: r["step_s"] for r in data["rows"] if r["layout"] == "data 4"}
    for row in data["rows"]:
        layout = row["layout"]
        data, hybrid = re.fullmatch(r"data (\d+)", layout), re.fullmatch(r"hybrid (\d+)\+(\d+)", layout)
        if data:
            world = int(data.group(1))
            strategy, batch = LayerRing(costs=costs()), 48 // world
        elif hybrid:
            conv, fc = int(hybrid.group(1)), int(hybrid.group(2))
            world, strategy, batch = conv + fc, ConvFcSplit(conv, fc, costs()), 48 // conv
        else:   # e.g. sub-batched activations ("K=4"): not modelled
            print(f"skipped {path.name}: {layout} (not modelled)", file=sys.stderr)
            continue
        kind = "busy" if busy(row["model"], None, dense.get(row["model"]), at_most=True) else "validation"
        yield Case(path.name, row["model"], f"loopback, {world} procs, global batch 48", strategy.label,
                   row["step_s"], step_time(strategy, row["model"], batch, loopback(world, cpus)), kind=kind)


def wire_byte_rows(path: Path, data: dict) -> Iterator[Case]:
    for row in data["rows"]:
        name, *rest = row["compressor"].split()
        fraction = float(rest[0].rstrip("%")) / 100 if rest and rest[0].endswith("%") else None
        compression = Compression(name, fraction=fraction or 0.01,
                                  blocks_per_layer=1 if rest[:1] == ["k=1"] else None,
                                  block_fraction=fraction if name == "blocktopk" else None,
                                  selection="global" if "global" in rest else "local")
        strategy, cluster = LayerRing(compression), Cluster(int(row["world"]), 1e9)
        yield Case(path.name, row["model"], f"{row['world']} workers", strategy.label, row["kB_sent/step"],
                   lambda s=strategy, m=row["model"], c=cluster: s.step_time(profile(m), c).sent_bytes / 1e3,
                   kind="bytes", unit="kB")


READERS: list[tuple[str, Callable[[Path, dict], Iterator[Case]]]] = [
    ("cluster_allreduce_*.json", allreduce_rows),
    ("engine_vs_ddp_cluster_*.json", strategy_rows),
    ("time_to_accuracy_*.json", strategy_rows),
    ("simulator_runs_*.json", strategy_rows),
    ("suite_*.json", suite_rows),
    ("ps.json", ps_rows),
    ("ps_full.json", ps_rows),
    ("hierarchical.json", hierarchical_rows),
    ("engine_vs_ddp.json", loopback_rows),
    ("hybrid.json", hybrid_rows),
    ("compression_wire_bytes.json", wire_byte_rows),
]


def plan_check(cases: list[Case]) -> list[dict]:
    """Per emulated setting: ``convoy plan``'s top pick against the fastest measured convoy strategy
    and the fastest measured peer (torch DDP, with or without PowerSGD).

    Both by samples per second (hybrid trains on fewer ranks than the cluster has).
    """
    from convoy.cli.plan import rank, train_choices, train_flags
    from convoy.sim.catalog import candidates

    out = []
    groups: dict[tuple, list[Case]] = {}
    peers: dict[tuple, dict[str, float]] = {}
    for case in cases:
        if case.runs and case.runs[0].peer:
            peers.setdefault((case.model, case.setting, case.kind, case.source), {})[case.strategy] = \
                case.runs[0].workers(case.runs[1]) * case.runs[2] / case.measured
        elif case.runs:
            groups.setdefault((case.model, case.setting, case.kind, case.source), []).append(case)
    for (model, setting, kind, source), mine in groups.items():
        _, cluster, batch = mine[0].runs
        measured = {c.strategy: c.runs[0].workers(cluster) * batch / c.measured for c in mine}
        peer = peers.get((model, setting, kind, source), {})
        prof = profile(model).at_batch(batch)
        has_head = any(l.head for l in prof.layers)
        # Plan's own settings, and the measured ones (their knobs may lie between plan's).
        tried = {s.label: s for s in candidates(cluster.nodes, cluster.racks, has_head, costs())}
        tried.update({c.strategy: c.runs[0] for c in mine})
        ranked = [r for r in rank(prof, cluster, list(tried.values()), train_flags(), train_choices())
                  if r["available"]]
        among = [r for r in ranked if r["strategy"] in measured]
        fastest = max(measured, key=measured.get)
        top = measured.get(ranked[0]["strategy"])
        fastest_peer = max(peer, key=peer.get) if peer else None
        out.append({"model": model, "setting": setting, "kind": kind, "source": source,
                    "plan_top": ranked[0]["strategy"], "plan_top_predicted_samples_s": ranked[0]["samples_per_s"],
                    "plan_second": ranked[1]["strategy"] if len(ranked) > 1 else None,
                    "plan_second_predicted_samples_s": ranked[1]["samples_per_s"] if len(ranked) > 1 else None,
                    "plan_top_measured_samples_s": top,
                    "plan_top_among_measured": among[0]["strategy"] if among else None,
                    "fastest_measured": fastest, "fastest_measured_samples_s": measured[fastest],
                    "agree": bool(among) and among[0]["strategy"] == fastest,
                    # How much throughput following plan's advice leaves on the table.
                    "plan_top_vs_fastest": top / measured[fastest] if top else None,
                    "fastest_peer": fastest_peer, "plan_top_vs_fastest_peer":
                        top / peer[fastest_peer] if top and fastest_peer else None,
                    "measured_order": sorted(measured, key=measured.get, reverse=True),
                    "plan_order": [r["strategy"] for r in among]})
    return out


def family(label: str) -> str:
    """The strategy a label belongs to, for the per-strategy summary."""
    words = label.split()
    if words[0] == "allreduce" and len(words) > 1:
        return words[1]
    return "powersgd" if "powersgd" in words else words[0]


def main() -> None:
    cases = [case for pattern, reader in READERS for path in sorted(RESULTS.glob(pattern))
             for case in reader(path, json.loads(path.read_text()))]
    rows = []
    for case in cases:
        predicted = case.predict()
        rows.append({"kind": case.kind, "source": case.source, "model": case.model, "setting": case.setting,
                     "strategy": case.strategy, "measured": case.measured, "predicted": predicted,
                     "unit": case.unit, "error_%": 100 * (predicted - case.measured) / case.measured})
    timed = [r for r in rows if r["unit"] == "s"]
    summary = []
    for kind in ("validation", "calibration", "busy"):
        for name in sorted({family(r["strategy"]) for r in timed if r["kind"] == kind}):
            errors = [abs(r["error_%"]) for r in timed if r["kind"] == kind and family(r["strategy"]) == name]
            summary.append({"kind": kind, "strategy": name, "cases": len(errors),
                            "mean_abs_error_%": statistics.mean(errors), "max_abs_error_%": max(errors)})
    plan = plan_check(cases)
    settings = {"profile_batch": PROFILE_BATCH, "loopback_bps": LOOPBACK_BPS, "costs": costs().__dict__,
                "emulated_wake_s": emulated_wake_s(), "emulated_wake_idle_s": emulated_wake_s(False),
                "summary": summary, "plan_check": plan}
    save("simulator_validation", settings, rows,
         ["kind", "source", "model", "setting", "strategy", "measured", "predicted", "unit", "error_%"])
    from bench.common import table

    print(table(summary, ["kind", "strategy", "cases", "mean_abs_error_%", "max_abs_error_%"]))
    md = RESULTS / "simulator_validation.md"
    plan_columns = ["source", "model", "setting", "kind", "plan_top", "plan_top_measured_samples_s", "plan_top_among_measured",
                    "fastest_measured", "fastest_measured_samples_s", "agree", "plan_top_vs_fastest",
                    "fastest_peer", "plan_top_vs_fastest_peer"]
    print(table(plan, plan_columns))
    md.write_text(md.read_text() + "\nPer strategy (timed rows):\n\n"
                  + table(summary, ["kind", "strategy", "cases", "mean_abs_error_%", "max_abs_error_%"])
                  + "\n\nconvoy plan against the measurements (samples/s):\n\n" + table(plan, plan_columns) + "\n")


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_simulator_runs(model: str) -> str:
    """The simulator against the measured steady steps of ``model`` at both link rates."""
    rows = [r for r in rows_of("simulator_validation")
            if r["source"].startswith(f"simulator_runs_{model}_") and r["unit"] == "s"]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    by = {(r["strategy"], rate): r for r in rows for rate in ("100mbit", "1gbit") if f" {rate}," in r["setting"]}

    def cells(strategy: str, rate: str) -> list[str]:
        r = by.get((strategy, rate))
        return ["-"] * 3 if r is None else [seconds(r["measured"]), seconds(r["predicted"]),
                                            f"{r['error_%']:+.0f}%"]
    return markdown_table(["strategy", "100 Mbit measured", "predicted", "error", "1 Gbit measured", "predicted",
                           "error"], [[s, *cells(s, "100mbit"), *cells(s, "1gbit")] for s in strategies])


def render_simulator_errors() -> str:
    rows = [r for r in rows_of("simulator_validation") if r["unit"] == "s"]
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        family = r["strategy"].split()[1] if r["strategy"].startswith("allreduce ") and \
            len(r["strategy"].split()) > 1 else r["strategy"].split()[0]
        family = "powersgd" if "powersgd" in r["strategy"] else family
        groups.setdefault((r["kind"], family), []).append(abs(r["error_%"]))
    within = sum(1 for r in rows if r["kind"] == "validation" and abs(r["error_%"]) <= 20)
    total = sum(1 for r in rows if r["kind"] == "validation")
    text = markdown_table(["kind", "strategy", "cases", "mean abs error", "max abs error"],
                          [[k, s, str(len(e)), f"{sum(e) / len(e):.0f}%", f"{max(e):.0f}%"]
                           for (k, s), e in sorted(groups.items())])
    return f"{text}\n\nValidation rows within 20%: {within} of {total}."


BLOCKS = (
    Block("simulator_vgg_fc", "Simulator against measured steps: vgg_fc", ("simulator_validation",),
          "the measured step on 4 emulated hosts", partial(render_simulator_runs, "vgg_fc"),
          rerun="python bench/simulator_validation.py (after the simulator_runs above)"),
    Block("simulator_resnet18", "Simulator against measured steps: resnet18", ("simulator_validation",),
          "the measured step on 4 emulated hosts", partial(render_simulator_runs, "resnet18"),
          rerun="python bench/simulator_validation.py (after the simulator_runs above)"),
    Block("simulator_errors", "Simulator error per strategy, every timed row", ("simulator_validation",),
          "every measured result file the script knows", render_simulator_errors,
          rerun="python bench/simulator_validation.py"),
)


if __name__ == "__main__":
    main()
