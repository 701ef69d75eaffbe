"""convoy plan ranking by time to accuracy, checked against the suite's measurements.

    python bench/plan_time_to_target.py

For each model the suite measured at two link rates, the steps to the target
measured at one rate (written as bench/results/steps_to_target_<model>_<rate>.json,
the format of ``convoy plan --steps-to-target``) and the simulator's step time
at the other rate predict every strategy's time to the target there. Plan's
first pick is then compared, by measured time to the target at that rate, with
the fastest measured convoy strategy and the fastest measured peer.

Writes bench/results/plan_time_to_target.{json,md} and the steps files.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, save, table  # noqa: E402
from bench.figures import Block, Row, load, number, seconds, table as markdown_table  # noqa: E402
from bench.simulator_validation import costs, emulated, profile  # noqa: E402
from bench.time_to_accuracy import STRATEGIES  # noqa: E402
from convoy.cli.plan import rank, train_choices, train_flags  # noqa: E402
from convoy.sim.catalog import candidates, from_flags  # noqa: E402
from convoy.sim.convergence import load_convergence  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def suite_settings() -> dict[tuple[str, str], tuple[dict, list[dict]]]:
    """(model, rate) -> (one suite file's machine and settings, every row of that setting in the suite files)."""
    out: dict[tuple[str, str], tuple[dict, list[dict]]] = {}
    for path in sorted(RESULTS.glob("suite_full_*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            key = (row["model"], row["rate"])
            settings = {**data["settings"], "model": row["model"], "rate": row["rate"]}
            out.setdefault(key, ({"machine": data["machine"], "settings": settings}, []))[1].append(row)
    return out


def train_flags_of(name: str) -> list[str]:
    """A suite strategy's ``convoy train`` flags (a peer's script by its file name), paths relative to the repo."""
    flags = STRATEGIES[name][1:] if STRATEGIES[name][0] == "train" else [Path(STRATEGIES[name][0]).name,
                                                                         *STRATEGIES[name][1:]]
    return [str(Path(f).relative_to(ROOT)) if f.startswith(str(ROOT)) else f for f in flags]


def write_steps_file(model: str, rate: str, data: dict, rows: list[dict], folder: Path = RESULTS) -> Path:
    """The setting's measured steps to the target, in ``convoy plan --steps-to-target``'s format (peers left out)."""
    s = data["settings"]
    runs = [{"flags": train_flags_of(r["strategy"]), "steps_to_target": r["steps_to_target"],
             "measured_at": rate} for r in rows if STRATEGIES[r["strategy"]][0] == "train"]
    path = folder / f"steps_to_target_{model}_{rate}.json"
    path.write_text(json.dumps({"model": model, "batch_size": int(s["batch_size"]), "nodes": int(s["hosts"]),
                                "target": float(s["target"]), "warmup_steps": int(s["warmup_steps"]),
                                "runs": runs}, indent=1) + "\n")
    return path


def measured_times(rows: list[dict], nodes: int) -> dict[str, tuple[float | None, bool]]:
    """Strategy label -> (measured time to the target or None, whether it is a peer)."""
    out = {}
    for r in rows:
        strategy = from_flags(train_flags_of(r["strategy"]), nodes, costs())
        out[strategy.label] = (r["time_to_target_s"], strategy.peer)
    return out


def check(model: str, rate: str, steps_rate: str, settings: dict) -> tuple[list[dict], dict]:
    """Plan at ``rate`` with the steps measured at ``steps_rate``: per-strategy rows and the verdict."""
    data, rows = settings[(model, rate)]
    cluster = emulated(data, model)
    prof = profile(model).at_batch(int(data["settings"]["batch_size"]))
    convergence = load_convergence(RESULTS / f"steps_to_target_{model}_{steps_rate}.json", cluster.nodes)
    convergence.check(model, prof.batch_size, cluster.nodes)
    tried = {s.label: s for s in candidates(cluster.nodes, cluster.racks, True, costs())}
    tried.update({s.label: s for s in convergence.strategies(cluster.nodes, costs()) if not s.peer})
    ranked = [r for r in rank(prof, cluster, list(tried.values()), train_flags(), train_choices(), convergence)
              if r["available"]]
    measured = measured_times(rows, cluster.nodes)
    per_strategy = [{"model": model, "rate": rate, "steps_from": steps_rate, "plan_rank": r["rank"],
                     "strategy": r["strategy"], "steps": r["steps_to_target"], "predicted_step_s": r["step_s"],
                     "predicted_time_s": r["time_to_target_s"], "measured_time_s": measured[r["strategy"]][0],
                     "error_%": _error(r["time_to_target_s"], measured[r["strategy"]][0])}
                    for r in ranked if r["strategy"] in measured]
    return per_strategy, _verdict(model, rate, steps_rate, ranked[0]["strategy"], measured)


def _error(predicted: float | None, measured: float | None) -> float | None:
    return 100 * (predicted - measured) / measured if predicted and measured else None


def _verdict(model: str, rate: str, steps_rate: str, top: str, measured: dict) -> dict:
    reached = {k: t for k, (t, _) in measured.items() if t is not None}
    own = {k: t for k, t in reached.items() if not measured[k][1]}
    peers = {k: t for k, t in reached.items() if measured[k][1]}
    fastest, fastest_peer = min(own, key=own.get), min(peers, key=peers.get) if peers else None
    top_s = reached.get(top)
    return {"model": model, "rate": rate, "steps_from": steps_rate, "plan_top": top, "plan_top_measured_s": top_s,
            "fastest_measured": fastest, "fastest_measured_s": own[fastest],
            "fastest_vs_plan_top": own[fastest] / top_s if top_s else None,
            "fastest_peer": fastest_peer, "fastest_peer_s": peers.get(fastest_peer),
            "peer_vs_plan_top": peers[fastest_peer] / top_s if top_s and fastest_peer else None}


def main() -> None:
    settings = suite_settings()
    for (model, rate), (data, rows) in settings.items():
        write_steps_file(model, rate, data, rows)
    per_strategy, verdicts = [], []
    for model, rate in sorted(settings):
        for steps_rate in sorted(r for m, r in settings if m == model and r != rate):
            rows, verdict = check(model, rate, steps_rate, settings)
            per_strategy += rows
            verdicts.append(verdict)
    columns = ["model", "rate", "steps_from", "plan_top", "plan_top_measured_s", "fastest_measured",
               "fastest_measured_s", "fastest_vs_plan_top", "fastest_peer", "fastest_peer_s", "peer_vs_plan_top"]
    save("plan_time_to_target", {"verdicts": verdicts}, per_strategy,
         ["model", "rate", "steps_from", "plan_rank", "strategy", "steps", "predicted_step_s", "predicted_time_s",
          "measured_time_s", "error_%"])
    print(table(verdicts, columns))
    md = RESULTS / "plan_time_to_target.md"
    md.write_text(md.read_text() + "\nPlan's first pick against the measured times to the target:\n\n"
                  + table(verdicts, columns) + "\n")


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_plan_time_to_target() -> str:
    data = load("plan_time_to_target") or {"settings": {}}
    verdicts = data["settings"].get("verdicts", [])
    rows = {(r["model"], r["rate"], r["strategy"]): r for r in data.get("rows", [])}

    def predicted(v: Row) -> str:
        r = rows.get((v["model"], v["rate"], v["plan_top"]))
        return seconds(r["predicted_time_s"]) if r else "-"
    return markdown_table(["model, link", "steps measured at", "plan's first", "predicted", "measured",
                           "fastest measured convoy strategy", "fastest / first", "fastest peer"],
                          [[f"{v['model']}, {v['rate']}", v["steps_from"], v["plan_top"], predicted(v),
                            seconds(v["plan_top_measured_s"]),
                            f"{v['fastest_measured']}: {seconds(v['fastest_measured_s'])}",
                            number(v["fastest_vs_plan_top"]), f"{v['fastest_peer']}: {seconds(v['fastest_peer_s'])}"]
                           for v in verdicts])


BLOCKS = (
    Block("plan_time_to_target", "convoy plan's first pick against the measured time to 97%",
          ("plan_time_to_target",), "the fastest measured convoy strategy and the fastest peer",
          render_plan_time_to_target, rerun="python bench/plan_time_to_target.py"),
)


if __name__ == "__main__":
    main()
