"""bench/README.md, and every figure block of the docs, generated from bench/results/*.json.

    python bench/make_readme.py           # rewrite bench/README.md and the blocks in README.md, docs/*.md
    python bench/make_readme.py --check   # exit 1, naming the stale files, when any differs

A figure in the documentation is never typed: each table sits between two markers,

    <!-- bench:NAME -->
    ...generated...
    <!-- /bench:NAME -->

and this script rewrites what is between them from the result files the benchmarks
wrote (``{"machine", "settings", "rows"}``, see bench/common.py). bench/README.md holds
every block, each with the command that measured it and the peer it is compared with;
a result file no block names still gets a plain table there, so a new benchmark shows
up without editing this script. tests/bench/test_bench_figures.py fails when the committed
files differ from this script's output.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCH_README = ROOT / "bench" / "README.md"
MARKER = re.compile(r"(<!-- bench:([\w.-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)

Row = dict[str, Any]


# 1. Reading result files and formatting cells -------------------------------------------

def load(name: str) -> dict[str, Any] | None:
    """bench/results/<name>.json, or None when that benchmark has not been run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def loaded(*names: str) -> list[dict[str, Any]]:
    """The result files of ``names`` that exist, in order."""
    return [data for name in names if (data := load(name))]


def rows_of(*names: str) -> list[Row]:
    return [row for data in loaded(*names) for row in data.get("rows", [])]


def seconds(value: Any, missing: str = "-") -> str:
    if value is None or value == "":
        return missing
    if value < 0.1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.0f} s" if value >= 100 else f"{value:.3g} s"


def percent(value: Any, missing: str = "-") -> str:
    return missing if value is None or value == "" else f"{100 * value:.1f}%"


def number(value: Any, missing: str = "-") -> str:
    if value is None or value == "":
        return missing
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def times(value: Any, missing: str = "-") -> str:
    return missing if value is None or value == "" else f"{value:.2f}x"


def table(header: Sequence[str], cells: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def measured_on(*names: str) -> str:
    """Where and when: the machine line of the result files (their commits and dates)."""
    stamps = []
    for name in names:
        data = load(name)
        if data and "machine" in data:
            m = data["machine"]
            stamps.append(f"{m.get('date', '?')[:10]}, commit {m.get('commit', '?')}")
    if not stamps:
        return ""
    first = load(names[0])["machine"] if load(names[0]) else {}
    where = f"{first.get('cpus', '?')} CPUs, torch {first.get('torch', '?')}"
    return f"Measured on {where} ({'; '.join(sorted(set(stamps)))})."


def recorded_command(block: "Block") -> str:
    """The commands the block's result files recorded as they ran; the block's own text for
    files measured before results recorded their command."""
    commands = [load(name).get("machine", {}).get("command") for name in block.sources if load(name)]
    if commands and all(commands):
        return "; ".join(dict.fromkeys(commands))
    return block.command


# 2. The blocks: one table each, with its command and its peer -----------------------------

@dataclass(frozen=True)
class Block:
    name: str          # the marker's NAME
    title: str         # heading in bench/README.md
    sources: tuple[str, ...]   # result files (without .json) it reads
    command: str       # how to measure it again
    peer: str          # what it is compared with
    render: Callable[[], str]
    emulated: bool = False   # builds network namespaces: root, and one at a time


def _default_job() -> str:
    rows = rows_of("default_job")
    return table(["seed", "test accuracy", "wall time (with start-up)", "steps", "97% within 180 s"],
                 [[str(r["seed"]), percent(r["test_accuracy"]), seconds(r["seconds"]), str(r["steps"]),
                   "yes" if r["meets_target"] else "no"] for r in rows])


def _engine_vs_ddp() -> str:
    rows = rows_of("engine_vs_ddp")
    return table(["model", "workers", "bucket KB", "engine step", "DDP step", "engine / DDP",
                  "engine waiting on comm", "MB sent / step / worker"],
                 [[r["model"], str(r["world"]), number(r.get("bucket_kb")), seconds(r["engine_step_s"]),
                   seconds(r["ddp_step_s"]), number(r["engine/ddp"]), seconds(r["engine_wait_s"]),
                   number(r["MB_sent/step"])] for r in rows])


def _engine_vs_ddp_cluster() -> str:
    cells = []
    for rate in ("1gbit", "100mbit"):
        by = {r["strategy"]: r for r in rows_of(f"engine_vs_ddp_cluster_{rate}")}
        if "dense" in by and "ddp" in by:
            cells.append([rate, seconds(by["dense"]["step_s"]), seconds(by["ddp"]["step_s"]),
                          number(by["dense"]["step_s"] / by["ddp"]["step_s"])])
    return table(["links", "engine step", "DDP step", "engine / DDP"], cells)


def _checkpoint(name: str) -> Callable[[], str]:
    return lambda: _checkpoint_table(rows_of(name))


def _checkpoint_table(rows: list[Row]) -> str:
    def cpu(r: Row) -> str:
        return "" if r["mode"] == "none" or "cpu_overhead_%" not in r else f"{r['cpu_overhead_%']:+.1f}%"

    def listener(r: Row) -> str:
        return "" if r.get("path_cpu_ms") in (None, "") else f"{r['path_cpu_ms']:.3g} / {r['persist_cpu_ms']:.3g} ms"

    def mean(r: Row) -> str:   # rows measured before the column was added have none
        return "" if r["mode"] == "none" or "mean_overhead_%" not in r else f"{r['mean_overhead_%']:+.1f}%"

    return table(["model", "mode", "median step", "overhead", "overhead of the mean step", "CPU overhead",
                  "listener CPU / step (training / persister)", "stall / ckpt", "MB / ckpt", "recovery"],
                 [[r["model"], r["mode"], seconds(r["median_step_s"]),
                   "" if r["mode"] == "none" else f"{r['overhead_%']:+.1f}%", mean(r), cpu(r), listener(r),
                   "" if r["mode"] == "none" else f"{r['stall_ms']:.3g} ms",
                   "" if r["mode"] == "none" else number(r["MB_per_ckpt"]),
                   seconds(r.get("recovery_s"), missing="")] for r in rows])


def _compression_selection() -> str:
    rows = rows_of("compression_selection")
    return table(["shapes", "values", "blocktopk L1", "blocktopk L2", "+ run-length coding", "torch.topk",
                  "torch.sum (one read)", "topk / blocktopk", "blocktopk / sum"],
                 [[r["model"], f"{r['values_M']:.3g} M", seconds(r["blocktopk_s"]), seconds(r["blocktopk_l2_s"]),
                   seconds(r["blocktopk_encode_s"]), seconds(r["topk_s"]), seconds(r["sum_s"]),
                   times(r["topk/blocktopk"]), times(r["blocktopk/sum"])] for r in rows])


def _compression_wire_bytes() -> str:
    rows = rows_of("compression_wire_bytes")
    compressors = list(dict.fromkeys(r["compressor"] for r in rows))
    settings = list(dict.fromkeys((r["model"], r["world"]) for r in rows))
    cell = {(r["model"], r["world"], r["compressor"]): r for r in rows}

    def show(model: str, world: int, name: str) -> str:
        r = cell.get((model, world, name))
        if r is None:
            return "-"
        return f"{r['kB_sent/step'] / 1000:.3g} MB" if r["ratio"] == 1 else f"{r['ratio']:.0f}x"
    return table(["model, workers", *compressors],
                 [[f"{m}, {w}", *(show(m, w, c) for c in compressors)] for m, w in settings])


def _compression_accuracy() -> str:
    rows = rows_of("compression_accuracy")
    return table(["method", "test accuracy", "vs dense (points)", "kB sent / step", "fewer bytes than dense"],
                 [[r["method"], f"{r['test_accuracy_%']:.2f}%", f"{r['vs dense (points)']:+.1f}",
                   number(r["kB_sent/step"]), times(r["ratio"])] for r in rows])


def _sparse_block_size() -> str:
    rows = rows_of("sparse_block_size")
    return table(["block size (0: rows and filters)", "vgg_fc selection", "resnet18 selection",
                  "vgg_fc accuracy", "vs dense (points)", "fewer bytes than dense"],
                 [[str(r["block_size"]), seconds(r.get("vgg_fc_select_s")), seconds(r.get("resnet18_select_s")),
                   percent(r.get("vgg_fc_accuracy")),
                   "-" if r.get("accuracy_vs_dense") is None else f"{100 * r['accuracy_vs_dense']:+.1f}",
                   times(r.get("bytes_vs_dense"))] for r in rows])


def _sparse_accuracy() -> str:
    rows = rows_of("sparse_accuracy")
    return table(["flags (with the issue's command)", "test accuracy", "MB sent per worker", "fewer bytes than dense",
                  "points below dense"],
                 [[f"`{r['flags']}`", f"{r['test_accuracy_%']:.2f}%", number(r["MB_sent"]), times(r["ratio_to_dense"]),
                   f"{r['points_below_dense']:.2f}"] for r in rows])


def _sparse_accuracy_seeds() -> str:
    rows = rows_of("sparse_accuracy_seeds")
    return table(["flags (with the issue's command)", "seed", "test accuracy", "points below dense at that seed",
                  "fewer bytes than dense"],
                 [[f"`{r['flags']}`", str(r["seed"]), f"{r['test_accuracy_%']:.2f}%", f"{r['points_below_dense']:.2f}",
                   times(r["ratio_to_dense"])] for r in rows])


def _ps_settings(name: str) -> Callable[[], str]:
    def render() -> str:
        return table(["setting", "step", "step / all-reduce step", "step / ps defaults' step"],
                     [[r["setting"], seconds(r.get("step_s")) if "error" not in r else f"failed: {r['error']}",
                       times(r.get("vs_all_reduce")), times(r.get("vs_ps_defaults"))] for r in rows_of(name)])
    return render


def _link_patterns() -> str:
    rows = rows_of("link_patterns_100mbit")
    return table(["TCP congestion control", "pattern", "each host's uplink", "of the ring's", "repeats"],
                 [[r["tcp_congestion"], r["pattern"], f"{r['Mbit_per_s']:.1f} Mbit/s", percent(r["vs_ring"]),
                   ", ".join(f"{v:g}" for v in r["repeats_Mbit_per_s"])] for r in rows])


def _staleness_rules() -> str:
    rows = rows_of("staleness_rules")
    return table(["rule", "seed", "steps to 97%", "best accuracy", "last accuracy"],
                 [[r["variant"], str(r["seed"]), number(r.get("steps_to_target"), "not reached"),
                   percent(r["best_accuracy"]), percent(r["final_accuracy"])] for r in rows])


def _time_to_accuracy(*names: str, reference: str | None = None) -> Callable[[], str]:
    """Rows of time_to_accuracy files; ``reference`` supplies the dense row where a file has none."""
    def render() -> str:
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
    return render


def _versus_peer(*names: str, peer: str = "powersgd") -> Callable[[], str]:
    """Rows of time_to_accuracy runs, each against its own run's ``peer`` row: times to 95% and to the
    target, and the peer's time over each (a peer that never got there within its steps is named)."""
    def render() -> str:
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
    return render


def _train_through_failures(name: str) -> Callable[[], str]:
    """Each run of bench/train_through_failures.py: times to the two levels, what its failures cost
    against the same strategy's run without them (its time over that one's), work re-done, time down."""
    def render() -> str:
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
    return render


def _stop_flag() -> str:
    return table(["variant", "us / step (best)", "median", "check cost us"],
                 [[r["variant"], f"{r['us_per_step_best']:.0f}", f"{r['us_per_step_median']:.0f}",
                   f"{r['check_us']:.0f}"] for r in rows_of("stop_flag")])


def _ddp_hook_stress() -> str:
    return table(["hook", "runs", "ended cleanly", "hung", "aborted", "failed"],
                 [[r["hook"], str(r["runs"]), str(r["ok"]), str(r["hang"]), str(r["abort"]), str(r["failed"])]
                  for r in rows_of("ddp_hook_stress")])


def _training_guards() -> str:
    rows = rows_of("training_guards")
    return table(["model", "mode", "step", "vs plain"],
                 [[r["model"], r["mode"], f"{r['step_ms']:.3g} ms", number(r["vs_plain"])] for r in rows])


def _hybrid() -> str:
    rows = rows_of("hybrid")
    return table(["model", "layout", "ring MB", "link MB", "total MB", "vs data", "busiest worker MB", "step",
                  "peak RSS conv (or data) / FC"],
                 [[r["model"], r["layout"], number(r["ring_MB/step/worker"]), number(r["link_MB/step/worker"]),
                   number(r["total_MB/step/worker"]), number(r["bytes_vs_data"]), number(r["max_MB/step/worker"]),
                   seconds(r["step_s"]),
                   f"{r['peak_MB_conv_or_data']:.0f}" + (f" / {r['peak_MB_fc']:.0f} MB" if r.get("peak_MB_fc") else " MB")]
                  for r in rows])


POWERSGD_CHANGES = (("before", "before"), ("c1", "+ average in the gradient buffer"), ("c2", "+ residual in one pass"),
                    ("c3", "+ thin factor on the left"), ("c4", "+ parameters read in place"),
                    ("c5", "+ column scales on scalars"), ("c6", "+ P left in flight"))


def _powersgd_step() -> str:
    """convoy's powersgd against the hook at each R, before and after the changes; after: against the floor."""
    def by_key(name: str) -> dict[tuple, Row]:
        return {(r["model"], r["variant"], r["rank"]): r for r in rows_of(name)}

    before, after = by_key("powersgd_step_before"), by_key("powersgd_step_after")
    cells = []
    for (model, variant, rank), row in after.items():
        if variant != "convoy":
            continue
        old = before.get((model, variant, rank), {})
        blocking = after.get((model, "convoy_blocking", rank), {})
        cells.append([model, str(rank), str(row.get("buckets", "-")), seconds(after[(model, "floor", None)]["cpu_s"]),
                      seconds(after[(model, "hook", rank)]["cpu_s"]), seconds(row["cpu_s"]),
                      number(old.get("cpu/hook")), number(row["cpu/hook"]), number(old.get("wall/hook")),
                      number(row["wall/hook"]), number(blocking.get("wall/hook")), number(row["cpu/floor"]),
                      number(row["wall/floor"]), seconds(row["forward_wait_s"]),
                      seconds(blocking.get("forward_wait_s"))])
    return table(["model", "R", "convoy buckets", "floor CPU / step", "hook CPU / step", "convoy CPU / step", "convoy CPU / hook, before",
                  "after", "convoy wall / hook, before", "after", "after, P blocking", "convoy CPU / floor",
                  "convoy wall / floor", "forward waiting", "forward waiting, P blocking"], cells)


def _powersgd_profile() -> str:
    """The auxiliary thread's CPU per stage, at each change (each file measured on its commit)."""
    stages = {tag: {(r["model"], r["rank"], r["stage"]): r["cpu_ms_per_step"] for r in rows_of(f"powersgd_profile_{tag}")}
              for tag, _ in POWERSGD_CHANGES}
    keys = [(r["model"], r["rank"], r["stage"]) for r in rows_of("powersgd_profile_before")]
    return table(["model", "R", "stage (CPU ms / step)", *(label for _, label in POWERSGD_CHANGES)],
                 [[model, str(rank), stage, *(f"{stages[tag][(model, rank, stage)]:.1f}"
                                              if (model, rank, stage) in stages[tag] else "-"
                                              for tag, _ in POWERSGD_CHANGES)]
                  for model, rank, stage in keys])


def _powersgd_kernels() -> str:
    rows = rows_of("powersgd_kernels")
    return table(["model", "matrix", "R", "product", "thin factor right", "thin factor left", "faster", "same bits"],
                 [[r["model"], r["matrix"], str(r["rank"]), r["product"], f"{r['thin_right_ms']:.2f} ms",
                   f"{r['thin_left_ms']:.2f} ms", times(r["thin_right_ms"] / r["thin_left_ms"]),
                   "yes" if r["same_bits"] else "no"] for r in rows])


def _hierarchical() -> str:
    rows = rows_of("hierarchical")
    return table(["run", "steps", "time to 97%", "accuracy at the common step", "final accuracy", "step (median)",
                  "inter-rack MB / step", "fewer than flat", "max drift"],
                 [[r["run"], str(r["steps"]),
                   seconds(r["time_to_target_s"], "not reached") + (f" (step {r['steps_to_target']})"
                                                                    if r["steps_to_target"] else ""),
                   percent(r["acc_at_common_step"]), percent(r["final_accuracy"]), seconds(r["step_s"]),
                   number(r["inter_rack_MB/step"]), times(r.get("inter_rack_vs_flat")), number(r["max_drift"])]
                  for r in rows])


def _ps(name: str) -> Callable[[], str]:
    def render() -> str:
        rows = rows_of(name)
        return table(["model", "link", "config", "workers", "step", "vs fifo", "samples / s", "steps measured"],
                     [[r["model"], r["rate"], r["config"], str(r["workers"]), seconds(r["step_s"]),
                       times(r["speedup_vs_fifo"]), number(r["samples/s"]), str(r["steps_measured"])]
                      for r in rows])
    return render


PS_COLOCATED = ("time_to_accuracy_vgg_fc_100mbit_ps", "time_to_accuracy_resnet18_100mbit_ps")


def _ps_steps(*names: str, versus: str = "graph step", sent: str = "MB sent / step / rank") -> Callable[[], str]:
    """Step time of colocated servers against convoy's ring all-reduce and against the ps-colocated row
    (graph priority, equal shares) of the same run; ``sent`` heads the bytes column (results measured
    before the metrics counted a colocated rank's server hold its pushes only)."""
    def render() -> str:
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
    return render


def _ps_time_to_accuracy() -> str:
    rows = rows_of("ps_time_to_accuracy")
    return table(["config", "time to 97%", "steps", "final accuracy"],
                 [[r["config"], seconds(r["time_to_target_s"], "not reached"), number(r["steps_to_target"]),
                   percent(r["final_accuracy"])] for r in rows])


def _cluster_allreduce() -> str:
    rows = rows_of("cluster_allreduce_100mbit_4", "cluster_allreduce_100mbit_4_busy",
                   "cluster_allreduce_1gbit_4", "cluster_allreduce_1gbit_4_busy")
    return table(["size", "hosts", "links", "ranks busy", "gloo all-reduce", "ring bound", "measured / bound"],
                 [[f"{r['size_MB']:g} MB", str(r["hosts"]), r["rate"], "yes" if r["busy"] else "no",
                   seconds(r["allreduce_s"]), seconds(r["ring_bound_s"]), number(r["measured/bound"])]
                  for r in rows])


SUITE_FILES = {
    ("vgg_fc", "1gbit"): ("suite_full_vgg_fc_1gbit",),
    ("vgg_fc", "100mbit"): ("suite_full_vgg_fc_100mbit", "suite_full_vgg_fc_100mbit_slow",
                            "suite_full_vgg_fc_100mbit_ps"),
    ("resnet18", "1gbit"): ("suite_full_resnet18_1gbit_a", "suite_full_resnet18_1gbit_b",
                            "suite_full_resnet18_1gbit_c"),
    ("resnet18", "100mbit"): ("suite_full_resnet18_100mbit_a", "suite_full_resnet18_100mbit_b",
                              "suite_full_resnet18_100mbit_c", "suite_full_resnet18_100mbit_blocktopk_global",
                              "suite_full_resnet18_100mbit_ps"),
}


def _suite(rows: list[Row]) -> str:
    dense = {(r["model"], r["rate"]): r for r in rows if r["strategy"] == "dense"}

    def speedup(r: Row) -> str:
        d = dense.get((r["model"], r["rate"]))
        return times(d["time_to_target_s"] / r["time_to_target_s"]) \
            if d and d["time_to_target_s"] and r["time_to_target_s"] else "-"
    return table(["model", "links", "strategy", "step", "step / limit", "time to 97%", "vs convoy all-reduce",
                  "accuracy at the end", "MB / step / worker"],
                 [[r["model"], r["rate"], r["strategy"], seconds(r["step_s"]), number(r["step_vs_limit"]),
                   seconds(r["time_to_target_s"], "not reached")
                   + (f" (step {r['steps_to_target']})" if r["steps_to_target"] else ""),
                   speedup(r), percent(r["final_accuracy"]), number(r["MB_sent/step"])] for r in rows])


def _suite_full(model: str) -> Callable[[], str]:
    return lambda: _suite([r for (m, _), names in SUITE_FILES.items() if m == model for r in rows_of(*names)])


def _headline() -> str:
    """vgg_fc's time to 97% per strategy at both link rates, from the full suite."""
    by = {(r["rate"], r["strategy"]): r for (m, _), names in SUITE_FILES.items() if m == "vgg_fc"
          for r in rows_of(*names)}
    strategies = list(dict.fromkeys(s for _, s in by))

    def cell(rate: str, strategy: str) -> str:
        r, ddp = by.get((rate, strategy)), by.get((rate, "ddp"))
        if r is None:
            return "-"
        if not r["time_to_target_s"]:
            return f"not reached ({percent(r['final_accuracy'])})"
        ratio = f", {times(ddp['time_to_target_s'] / r['time_to_target_s'])}" if ddp and ddp["time_to_target_s"] else ""
        return f"{seconds(r['time_to_target_s'])}{ratio}"
    return table(["strategy", "100 Mbit: time to 97%, vs torch DDP", "1 Gbit: time to 97%, vs torch DDP"],
                 [[s, cell("100mbit", s), cell("1gbit", s)] for s in strategies])


def _accuracy_at_budget() -> str:
    cells = []
    for model in ("vgg_fc", "resnet18"):
        for rate in ("100mbit", "1gbit"):
            rows = rows_of(f"accuracy_at_budget_{model}_{rate}")
            if rows:
                ranked = sorted(rows, key=lambda r: -(r["accuracy_at_budget"] or 0))
                cells.append([f"{model}, {rate}", seconds(rows[0]["budget_s"]),
                              ", ".join(f"{r['strategy']} {percent(r['accuracy_at_budget'], 'not evaluated yet')}"
                                        for r in ranked)])
    return table(["setting", "budget (the first run to 97%)", "accuracy at the budget"], cells)


def _steady_steps() -> str:
    cells = []
    for model in ("vgg_fc", "resnet18"):
        by_rate = {rate: {r["strategy"]: r for r in rows_of(f"simulator_runs_{model}_{rate}")}
                   for rate in ("100mbit", "1gbit")}
        for strategy in dict.fromkeys(s for rows in by_rate.values() for s in rows):
            slow, fast = by_rate["100mbit"].get(strategy, {}), by_rate["1gbit"].get(strategy, {})
            cells.append([model, strategy, seconds(slow.get("step_s")), seconds(fast.get("step_s")),
                          number((slow or fast).get("MB_sent/step"))])
    return table(["model", "strategy", "step at 100 Mbit", "step at 1 Gbit", "MB / step / worker"], cells)


def _simulator_runs(model: str) -> Callable[[], str]:
    def render() -> str:
        rows = [r for r in rows_of("simulator_validation")
                if r["source"].startswith(f"simulator_runs_{model}_") and r["unit"] == "s"]
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        by = {(r["strategy"], rate): r for r in rows for rate in ("100mbit", "1gbit") if f" {rate}," in r["setting"]}

        def cells(strategy: str, rate: str) -> list[str]:
            r = by.get((strategy, rate))
            return ["-"] * 3 if r is None else [seconds(r["measured"]), seconds(r["predicted"]),
                                                f"{r['error_%']:+.0f}%"]
        return table(["strategy", "100 Mbit measured", "predicted", "error", "1 Gbit measured", "predicted",
                      "error"], [[s, *cells(s, "100mbit"), *cells(s, "1gbit")] for s in strategies])
    return render


def _simulator_errors() -> str:
    rows = [r for r in rows_of("simulator_validation") if r["unit"] == "s"]
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        family = r["strategy"].split()[1] if r["strategy"].startswith("allreduce ") and \
            len(r["strategy"].split()) > 1 else r["strategy"].split()[0]
        family = "powersgd" if "powersgd" in r["strategy"] else family
        groups.setdefault((r["kind"], family), []).append(abs(r["error_%"]))
    within = sum(1 for r in rows if r["kind"] == "validation" and abs(r["error_%"]) <= 20)
    total = sum(1 for r in rows if r["kind"] == "validation")
    text = table(["kind", "strategy", "cases", "mean abs error", "max abs error"],
                 [[k, s, str(len(e)), f"{sum(e) / len(e):.0f}%", f"{max(e):.0f}%"]
                  for (k, s), e in sorted(groups.items())])
    return f"{text}\n\nValidation rows within 20%: {within} of {total}."


def _simulator_projection() -> str:
    rows = rows_of("simulator_projection")
    settings = list(dict.fromkeys((r["model"], r["gbit"]) for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    eff = {(r["model"], r["gbit"], r["nodes"], r["strategy"]): r["efficiency"] for r in rows}
    parts = []
    for nodes in (64, 1024):
        parts.append(f"{nodes} nodes:\n\n" + table(
            ["strategy", *(f"{m} {g}G" for m, g in settings)],
            [[s, *(f"{100 * eff[(m, g, nodes, s)]:.0f}%" if (m, g, nodes, s) in eff else "-" for m, g in settings)]
             for s in strategies]))
    return "\n\n".join(parts)


def _horovod_check() -> str:
    data = load("simulator_projection") or {"settings": {}}
    check = data["settings"].get("horovod_check", {})
    return table(["model", "Horovod (512 GPUs, 25 Gbit)", "simulator", "predicted step"],
                 [[m, percent(c.get("published")), percent(c.get("predicted")), seconds(c.get("step_s"))]
                  for m, c in check.items()])


def _plan_time_to_target() -> str:
    data = load("plan_time_to_target") or {"settings": {}}
    verdicts = data["settings"].get("verdicts", [])
    rows = {(r["model"], r["rate"], r["strategy"]): r for r in data.get("rows", [])}

    def predicted(v: Row) -> str:
        r = rows.get((v["model"], v["rate"], v["plan_top"]))
        return seconds(r["predicted_time_s"]) if r else "-"
    return table(["model, link", "steps measured at", "plan's first", "predicted", "measured",
                  "fastest measured convoy strategy", "fastest / first", "fastest peer"],
                 [[f"{v['model']}, {v['rate']}", v["steps_from"], v["plan_top"], predicted(v),
                   seconds(v["plan_top_measured_s"]), f"{v['fastest_measured']}: {seconds(v['fastest_measured_s'])}",
                   number(v["fastest_vs_plan_top"]), f"{v['fastest_peer']}: {seconds(v['fastest_peer_s'])}"]
                  for v in verdicts])


def _simulator_checks() -> str:
    rows = rows_of("simulator_checks")
    return table(["check", "small collective done after", "large collective done after"],
                 [[r["check"], seconds(r["small_done_s"]), seconds(r["large_done_s"])]
                  for r in rows if r["check"] == "lanes"])


TTA = ("python bench/time_to_accuracy.py --model vgg_fc --lr 0.02 --batch-size 16 --steps 400 "
       "--eval-every 25 --warmup-steps 20 --rate 100mbit")
SIM_RUNS = tuple(f"simulator_runs_{m}_{r}" for m in ("vgg_fc", "resnet18") for r in ("100mbit", "1gbit"))

BLOCKS: tuple[Block, ...] = (
    Block("default_job", "The default job", ("default_job",),
          "python bench/default_job.py", "the goal: 97% test accuracy within 180 s", _default_job),
    Block("engine_vs_ddp", "Engine against torch DDP, loopback", ("engine_vs_ddp",),
          "python bench/engine_vs_ddp.py --models vgg_fc resnet18 --worlds 2 --steps 20",
          "torch DDP, same model, data, initialisation and optimizer", _engine_vs_ddp),
    Block("engine_vs_ddp_cluster", "Engine against torch DDP, 4 emulated hosts",
          ("engine_vs_ddp_cluster_1gbit", "engine_vs_ddp_cluster_100mbit"),
          "python bench/time_to_accuracy.py --strategies dense ddp --rate 1gbit|100mbit",
          "torch DDP", _engine_vs_ddp_cluster, emulated=True),
    Block("cluster_allreduce", "gloo all-reduce on emulated hosts",
          ("cluster_allreduce_100mbit_4", "cluster_allreduce_100mbit_4_busy", "cluster_allreduce_1gbit_4",
           "cluster_allreduce_1gbit_4_busy"),
          "python bench/cluster_allreduce.py --rate 100mbit|1gbit [--busy]",
          "the bandwidth-optimal ring, 2 (N - 1) / N x bytes / rate", _cluster_allreduce, emulated=True),
    Block("checkpoint", "Checkpointing every step", ("checkpoint",),
          "python bench/checkpoint.py --models resnet18 --steps 10 --rounds 2",
          "torch.save and torch.distributed.checkpoint's async_save every step; torch.load for recovery",
          _checkpoint("checkpoint")),
    Block("checkpoint_blocktopk", "Checkpointing every step under blocktopk (differential checkpoints)",
          ("checkpoint_blocktopk",), "python bench/checkpoint.py --models resnet18 --steps 10 --rounds 2 "
          "--compress blocktopk",
          "torch.save with fsync every step, each rank's residuals included",
          _checkpoint("checkpoint_blocktopk")),
    Block("checkpoint_blocktopk_ab", "Differential checkpoints against none, paired (blocktopk)",
          ("checkpoint_blocktopk_ab",), "python bench/checkpoint.py --models resnet18 --steps 10 --rounds 20 "
          "--compress blocktopk --modes none convoy --tag ab",
          "no checkpoint, the two modes alternating twenty times", _checkpoint("checkpoint_blocktopk_ab")),
    Block("checkpoint_blocktopk_long", "Differential checkpoints against none, long enough for full snapshots",
          ("checkpoint_blocktopk_long",), "python bench/checkpoint.py --models resnet18 --steps 110 --rounds 3 "
          "--compress blocktopk --modes none convoy --tag long",
          "no checkpoint, alternating; 110 steps a round, so the full snapshots the listener spaces count",
          _checkpoint("checkpoint_blocktopk_long")),
    Block("ddp_hook_stress", "DDP comm hooks: fresh two-process gloo jobs that must all end cleanly",
          ("ddp_hook_stress",), "python bench/ddp_hook_stress.py --runs 50 --hooks blocktopk powersgd fp16 topk "
          "--timeout 120", "no peer: the bar is zero hangs and aborts", _ddp_hook_stress),
    Block("train_through_failures", "Training through failures: vgg_fc, 4 hosts at 100 Mbit, a host killed every "
          "80 steps", ("train_through_failures_vgg_fc_100mbit",),
          "flock /tmp/convoy-netns.lock python bench/train_through_failures.py --model vgg_fc --kill-every 80",
          "torch DDP + torch's PowerSGD hook (rank 2) with a DCP checkpoint every 20 steps, restarted by torchrun "
          "on the full world (the lost host replaced at once), in the same run; and each strategy without failures",
          _train_through_failures("train_through_failures_vgg_fc_100mbit"), emulated=True),
    Block("stop_flag", "What the stop signal adds to the guard's per-step flag", ("stop_flag",),
          "python bench/stop_flag.py --steps 1000 --rounds 5 --world 2",
          "the loss flag alone (before the stop signal travelled in it)", _stop_flag),
    Block("compression_selection", "Block selection against torch.topk", ("compression_selection",),
          "python -m bench.compression.selection", "torch.topk at the same number of elements",
          _compression_selection),
    Block("compression_wire_bytes", "Bytes each worker sends per step", ("compression_wire_bytes",),
          "python -m bench.compression.wire_bytes",
          "dense fp32 all-reduce (first column; the others are how many times fewer bytes)",
          _compression_wire_bytes),
    Block("compression_accuracy", "Accuracy of the compressors, lenet, 4 workers", ("compression_accuracy",),
          "python -m bench.compression.accuracy", "torch DDP with torch's PowerSGD hook", _compression_accuracy),
    Block("powersgd_step", "convoy's PowerSGD step against DDP + torch's PowerSGD hook, loopback",
          ("powersgd_step_after", "powersgd_step_before"),
          "python bench/powersgd_step.py --blocking-rounds --tag after; --tag before on the commit before the changes",
          "DDP + torch's powerSGD_hook at the same rank R (warm start, error feedback, one bucket) and the same "
          "ranks with no exchange (the floor), rounds interleaved in each run", _powersgd_step),
    Block("powersgd_profile", "Where convoy's PowerSGD step spends its auxiliary thread's CPU",
          tuple(f"powersgd_profile_{tag}" for tag, _ in POWERSGD_CHANGES),
          "python bench/powersgd_step.py --profile --ranks 4 --rounds 6 --tag TAG, each on its commit",
          "the step before each change", _powersgd_profile),
    Block("powersgd_kernels", "PowerSGD's products with the thin factor on either side", ("powersgd_kernels",),
          "python bench/powersgd_step.py --kernels --rounds 30",
          "the products as written, thin factor on the right (what convoy ran before)", _powersgd_kernels),
    Block("sparse_accuracy", "Compressed against dense, vgg_fc, 2 workers, 300 steps", ("sparse_accuracy",),
          "python -m bench.sparse_accuracy", "dense all-reduce (accuracy and bytes over the whole run)",
          _sparse_accuracy),
    Block("sparse_accuracy_seeds", "The loopback check at seeds 5-8", ("sparse_accuracy_seeds",),
          "python -m bench.sparse_accuracy --seeds 5 6 7 8 --parallel 2",
          "dense all-reduce at the same seed", _sparse_accuracy_seeds),
    Block("sparse_block_size", "blocktopk's block size", ("sparse_block_size",),
          "python -m bench.sparse_block_size", "dense all-reduce (accuracy and bytes)", _sparse_block_size),
    Block("tta_vgg_fc_100mbit", "Time to 97%: compressors, vgg_fc, 4 hosts at 100 Mbit",
          ("time_to_accuracy_vgg_fc_100mbit", "time_to_accuracy_vgg_fc_100mbit_powersgd"),
          f"{TTA} (PowerSGD again with --tag powersgd --strategies powersgd)",
          "torch DDP and DDP + PowerSGD (rank 2), same data order",
          _time_to_accuracy("time_to_accuracy_vgg_fc_100mbit", "time_to_accuracy_vgg_fc_100mbit_powersgd",
                            reference="time_to_accuracy_vgg_fc_100mbit"), emulated=True),
    Block("tta_vgg_fc_100mbit_sparse", "Time to 97%: sparse blocktopk 1% with DGC's corrections",
          ("time_to_accuracy_vgg_fc_100mbit_sparse",),
          "python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --target 0.97 "
          "--strategies powersgd blocktopk --tag sparse",
          "DDP + PowerSGD (rank 2); dense from the 100 Mbit run above",
          _time_to_accuracy("time_to_accuracy_vgg_fc_100mbit_sparse", reference="time_to_accuracy_vgg_fc_100mbit"),
          emulated=True),
    Block("tta_vgg_fc_100mbit_powersgd_engine", "Time to 95% and 97%: convoy's compressors against DDP + PowerSGD",
          ("time_to_accuracy_vgg_fc_100mbit_i18",),
          "python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --target 0.97 "
          "--strategies powersgd convoy-powersgd blocktopk",
          "DDP + torch's PowerSGD hook (rank 2) in the same run (powersgd; the ratios are its time over each row's)",
          _versus_peer("time_to_accuracy_vgg_fc_100mbit_i18"), emulated=True),
    Block("tta_resnet18_100mbit_peer", "Time to 95% and 97%: resnet18, convoy's compressors against DDP + PowerSGD",
          ("time_to_accuracy_resnet18_100mbit_i18", "time_to_accuracy_resnet18_100mbit_i18b",
           "time_to_accuracy_resnet18_100mbit_i18c", "time_to_accuracy_resnet18_100mbit_i18d"),
          "python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model resnet18 --target 0.97 --eval-every 25 "
          "--tag i18 --strategies powersgd convoy-powersgd blocktopk fp16 (run 1); --tag i18b --strategies "
          "powersgd fp16 (run 2); --tag i18c --strategies powersgd fp16 (run 3, a fresh clone); without "
          "--eval-every (20), --tag i18d --strategies powersgd blocktopk (run 4, blocktopk scoring blocks by L2)",
          "DDP + torch's PowerSGD hook (rank 2), in each run (the ratios are its time in that run over each row's)",
          _versus_peer("time_to_accuracy_resnet18_100mbit_i18", "time_to_accuracy_resnet18_100mbit_i18b",
                       "time_to_accuracy_resnet18_100mbit_i18c", "time_to_accuracy_resnet18_100mbit_i18d"),
          emulated=True),
    Block("tta_vgg_fc_1gbit_peer", "Time to 95% and 97% at 1 Gbit: vgg_fc, convoy against DDP + PowerSGD",
          ("time_to_accuracy_vgg_fc_1gbit",),
          "python bench/time_to_accuracy.py --hosts 4 --rate 1gbit --model vgg_fc --target 0.97 --strategies "
          "powersgd convoy-powersgd blocktopk dense",
          "DDP + torch's PowerSGD hook (rank 2) in the same run (powersgd; the ratios are its time over each row's)",
          _versus_peer("time_to_accuracy_vgg_fc_1gbit"), emulated=True),
    Block("tta_resnet18_1gbit_peer", "Time to 95% and 97% at 1 Gbit: resnet18, convoy against DDP + PowerSGD",
          ("time_to_accuracy_resnet18_1gbit",),
          "python bench/time_to_accuracy.py --hosts 4 --rate 1gbit --model resnet18 --target 0.97 --eval-every 25 "
          "--strategies powersgd convoy-powersgd blocktopk fp16",
          "DDP + torch's PowerSGD hook (rank 2) in the same run (powersgd; the ratios are its time over each row's)",
          _versus_peer("time_to_accuracy_resnet18_1gbit"), emulated=True),
    Block("tta_vgg_fc_straggler", "Time to 97%: vgg_fc, 4 hosts at 100 Mbit, one at a quarter of the others' speed",
          ("time_to_accuracy_vgg_fc_straggler",),
          "python bench/time_to_accuracy.py --model vgg_fc --target 0.97 --cluster bench/straggler.toml "
          "--strategies dense ps-colocated ps-colocated-s2",
          "convoy's all-reduce (dense) in the same run; ps-colocated-s2 is --staleness 2",
          _time_to_accuracy("time_to_accuracy_vgg_fc_straggler"), emulated=True),
    Block("tta_vgg_fc_slow_link", "Time to 97%: vgg_fc, 3 hosts at 200 Mbit and one at 50 Mbit",
          ("time_to_accuracy_vgg_fc_slow_link",),
          "python bench/time_to_accuracy.py --model vgg_fc --target 0.97 --cluster bench/slow_link.toml "
          "--strategies dense ps-colocated-by-link",
          "convoy's all-reduce (dense) in the same run; ps-colocated-by-link is --shard-weights from the links",
          _time_to_accuracy("time_to_accuracy_vgg_fc_slow_link"), emulated=True),
    Block("ps_slow_link_steps", "Colocated servers' step with one host on a slower link",
          ("time_to_accuracy_vgg_fc_slow_link_steps",),
          "python bench/time_to_accuracy.py --model vgg_fc --steps 13 --eval-every 13 --target 0.999 "
          "--cluster bench/slow_link.toml --tag steps --strategies dense ps-colocated ps-colocated-by-link "
          "ps-colocated-s2-by-link",
          "convoy's ring all-reduce (dense) and the servers on equal shares (ps-colocated), in the same run",
          _ps_steps("time_to_accuracy_vgg_fc_slow_link_steps", versus="equal shares' step",
                    sent="MB sent / step / rank (ps: its pushes only)"), emulated=True),
    Block("ps_settings", "The colocated step under its transfer settings, vgg_fc, 4 hosts at 100 Mbit",
          ("ps_settings_vgg_fc_100mbit",), "python bench/ps_settings.py --hosts 4 --rate 100mbit --model vgg_fc "
          "--steps 25", "convoy's ring all-reduce and the ps defaults, in the same run",
          _ps_settings("ps_settings_vgg_fc_100mbit"), emulated=True),
    Block("ps_settings_cubic", "The colocated step under its transfer settings, hosts on TCP cubic",
          ("ps_settings_vgg_fc_100mbit_cubic",), "python bench/ps_settings.py --hosts 4 --rate 100mbit "
          "--model vgg_fc --steps 25 --tcp-congestion cubic",
          "convoy's ring all-reduce and the ps defaults, in the same run",
          _ps_settings("ps_settings_vgg_fc_100mbit_cubic"), emulated=True),
    Block("link_patterns", "How much of each link a ring and all-to-all traffic get, 4 hosts at 100 Mbit",
          ("link_patterns_100mbit",), "python bench/link_patterns.py --hosts 4 --rate 100mbit --repeats 5",
          "the ring pattern in the same cluster", _link_patterns, emulated=True),
    Block("staleness_rules", "What a fixed delay of 2 steps costs vgg_fc, simulated in one process",
          ("staleness_rules",), "python bench/staleness_rules.py",
          "the synchronous rule (staleness 0) on the same seeds", _staleness_rules),
    Block("tta_lenet_100mbit", "Time to 97%: lenet, 4 hosts at 100 Mbit", ("time_to_accuracy_lenet_100mbit",),
          "python bench/time_to_accuracy.py --model lenet --lr 0.05 --batch-size 32 --steps 600 --eval-every 20 "
          "--rate 100mbit", "torch DDP and DDP + PowerSGD",
          _time_to_accuracy("time_to_accuracy_lenet_100mbit"), emulated=True),
    Block("training_guards", "What the training guards cost", ("training_guards",),
          "python bench/training_guards.py", "the plain engine in the same run", _training_guards),
    Block("hybrid", "Hybrid layout: bytes per worker per step, loopback", ("hybrid",),
          "python bench/hybrid.py --steps 12", "data parallelism on the same 4 processes and global batch", _hybrid),
    Block("tta_vgg_fc_hybrid", "Time to 97%: hybrid, vgg_fc, 4 hosts at 100 Mbit and on loopback",
          ("time_to_accuracy_vgg_fc_100mbit_hybrid", "time_to_accuracy_vgg_fc_loopback"),
          f"{TTA.replace(' --warmup-steps 20', '')} --tag hybrid --strategies hybrid-3+1 hybrid-2+2; "
          "--rate loopback for 4 local processes",
          "convoy data-parallel all-reduce (at 100 Mbit: its row in the compressors' run)",
          _time_to_accuracy("time_to_accuracy_vgg_fc_100mbit_hybrid", "time_to_accuracy_vgg_fc_loopback",
                                          reference="time_to_accuracy_vgg_fc_100mbit"), emulated=True),
    Block("hierarchical", "Hierarchical sync on two emulated racks", ("hierarchical",),
          "python bench/hierarchical.py",
          "flat all-reduce, and torch's hierarchical SGD (post-local-SGD hook + HierarchicalModelAverager, "
          "bench/peers/hier_sgd.py)", _hierarchical, emulated=True),
    Block("ps", "Parameter server: step time by priority mode (default subset)", ("ps",),
          "python bench/ps.py", "FIFO (whole tensors, one channel, no window) and ring all-reduce",
          _ps("ps"), emulated=True),
    Block("ps_full", "Parameter server: every configuration", ("ps_full",),
          "python bench/ps.py --full", "FIFO and ring all-reduce", _ps("ps_full"), emulated=True),
    Block("ps_colocated", "Colocated parameter servers: step time, 4 hosts at 100 Mbit", PS_COLOCATED,
          "python bench/time_to_accuracy.py --hosts 4 --rate 100mbit --model vgg_fc --steps 60 --eval-every 30 "
          "--target 0.999 --strategies dense ps-colocated ps-colocated-fifo --tag ps; the same with --model "
          "resnet18 --steps 20 --eval-every 20 --strategies ps-colocated ps-colocated-fifo",
          "convoy's ring all-reduce (dense) and the same servers in arrival order (ps-colocated-fifo)",
          _ps_steps(*PS_COLOCATED), emulated=True),
    Block("ps_time_to_accuracy", "Parameter server: time to 97%, vgg_fc, 1 Gbit", ("ps_time_to_accuracy",),
          "python bench/ps.py --tta", "ring all-reduce with about the same global batch",
          _ps_time_to_accuracy, emulated=True),
    Block("headline", "vgg_fc to 97% on 4 emulated hosts, every strategy",
          tuple(n for (m, _), ns in SUITE_FILES.items() if m == "vgg_fc" for n in ns),
          "python bench/suite.py --profile full --models vgg_fc",
          "torch DDP (the ratio: its time over the strategy's) and DDP + PowerSGD (row powersgd)",
          _headline, emulated=True),
    Block("suite_small", "The comparison suite, small profile (lenet)", ("suite_small",),
          "python bench/suite.py --profile small", "torch DDP",
          lambda: _suite(rows_of("suite_small")), emulated=True),
    Block("suite_vgg_fc", "The comparison suite, full profile: vgg_fc",
          tuple(n for (m, _), ns in SUITE_FILES.items() if m == "vgg_fc" for n in ns),
          "python bench/suite.py --profile full --models vgg_fc --rates 1gbit|100mbit [--strategies ...] --tag TAG",
          "torch DDP and DDP + PowerSGD rank 2", _suite_full("vgg_fc"), emulated=True),
    Block("suite_resnet18", "The comparison suite, full profile: resnet18",
          tuple(n for (m, _), ns in SUITE_FILES.items() if m == "resnet18" for n in ns),
          "python bench/suite.py --profile full --models resnet18 --rates 1gbit|100mbit [--strategies ...] --tag TAG",
          "torch DDP and DDP + PowerSGD rank 2", _suite_full("resnet18"), emulated=True),
    Block("accuracy_at_budget", "Every strategy at one wall-time budget",
          tuple(f"accuracy_at_budget_{m}_{r}" for m in ("vgg_fc", "resnet18") for r in ("100mbit", "1gbit")),
          "python bench/accuracy_at_budget.py FILES --name NAME",
          "the first run of the setting to reach 97%", _accuracy_at_budget),
    Block("simulator_runs", "Steady step of every strategy, 4 emulated hosts", SIM_RUNS,
          "python bench/simulator_runs.py --model vgg_fc|resnet18 --rate 100mbit|1gbit",
          "torch DDP and DDP + PowerSGD (rows ddp, powersgd)", _steady_steps, emulated=True),
    Block("simulator_vgg_fc", "Simulator against measured steps: vgg_fc", ("simulator_validation",),
          "python bench/simulator_validation.py (after the simulator_runs above)",
          "the measured step on 4 emulated hosts", _simulator_runs("vgg_fc")),
    Block("simulator_resnet18", "Simulator against measured steps: resnet18", ("simulator_validation",),
          "python bench/simulator_validation.py (after the simulator_runs above)",
          "the measured step on 4 emulated hosts", _simulator_runs("resnet18")),
    Block("simulator_errors", "Simulator error per strategy, every timed row", ("simulator_validation",),
          "python bench/simulator_validation.py", "every measured result file the script knows", _simulator_errors),
    Block("simulator_checks", "gloo runs two collectives at once", ("simulator_checks",),
          "python bench/simulator_checks.py", "a small all-reduce started after a large one", _simulator_checks),
    Block("plan_time_to_target", "convoy plan's first pick against the measured time to 97%",
          ("plan_time_to_target",), "python bench/plan_time_to_target.py",
          "the fastest measured convoy strategy and the fastest peer", _plan_time_to_target),
    Block("simulator_projection", "Projected scaling efficiency (a model, not a measurement)",
          ("simulator_projection",), "python bench/simulator_projection.py",
          "N x convoy's engine on one node", _simulator_projection),
    Block("horovod_check", "The simulator against Horovod's published table", ("simulator_projection",),
          "python bench/simulator_projection.py", "Horovod's benchmark page (512 GPUs, 25 Gbit RoCE)",
          _horovod_check),
)
BY_NAME = {b.name: b for b in BLOCKS}


def render_block(name: str) -> str:
    """The text between a block's markers: the table, then the command and the peer."""
    block = BY_NAME[name]
    if not any(load(s) for s in block.sources):
        return f"(not measured yet: `{block.command}`)\n"
    stamp = measured_on(*block.sources)
    # A renderer that fails (a benchmark changed its columns) fails the run: --check must not pass over it.
    body = block.render()
    where = " (as root, under `flock /tmp/convoy-netns.lock`: it builds emulated hosts)" if block.emulated else ""
    return (f"{body}\n\nCommand: `{recorded_command(block)}`{where}. Compared with: {block.peer}. {stamp}\n"
            f"Generated by `python bench/make_readme.py` from bench/results/{block.sources[0]}.json"
            f"{' and others' if len(block.sources) > 1 else ''}; do not edit.\n")


# 3. Files no block names: a plain table, so new benchmarks show up ------------------------

def _plain(name: str, data: dict[str, Any]) -> str:
    rows = data.get("rows", [])
    columns = [c for c in dict.fromkeys(k for r in rows for k in r)
               if all(not isinstance(r.get(c), (list, dict)) for r in rows)]
    body = table(columns, [[number(r.get(c), "") for c in columns] for r in rows]) if rows else "(no rows)"
    return f"### {name}\n\n{body}\n\nSettings: `{json.dumps(data.get('settings', {}))}`. {measured_on(name)}\n"


def unclaimed() -> list[str]:
    claimed = {s for b in BLOCKS for s in b.sources}
    names = []
    for path in sorted(RESULTS.glob("*.json")):
        if path.stem in claimed:
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            names.append(path.stem)
    return names


# 4. The files -------------------------------------------------------------------------------

HEADER = """# Benchmarks: every measured figure

Generated by `python bench/make_readme.py` from `bench/results/*.json`; do not edit
(tests/bench/test_bench_figures.py checks this file against the script). Each table says
the command that measured it and the peer it is compared with. The machine is a
2-core x86 CPU VM with torch 2.13.0 CPU and gloo, one torch thread per worker, often
shared with other jobs: absolute times are inflated and noisy, ratios measured inside
one run are what to read. What the figures mean, and where they fall short of their
goals, is in the capability pages under docs/ (docs/benchmarks.md lists them).
"""


def render_bench_readme() -> str:
    parts = [HEADER]
    for block in BLOCKS:
        parts.append(f"## {block.title}\n\n<!-- bench:{block.name} -->\n{render_block(block.name)}"
                     f"<!-- /bench:{block.name} -->\n")
    extra = unclaimed()
    if extra:
        parts.append("## Other result files\n\nNo section above reads these yet; each as written.\n")
        parts += [_plain(name, json.loads((RESULTS / f"{name}.json").read_text())) for name in extra]
    return "\n".join(parts)


def refresh_blocks(text: str) -> str:
    """``text`` with every known ``<!-- bench:NAME -->`` block regenerated."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in BY_NAME:
            raise ValueError(f"unknown figure block '{name}'; known: {', '.join(BY_NAME)}")
        return f"{match.group(1)}{render_block(name)}{match.group(4)}"
    return MARKER.sub(replace, text)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def expected_files() -> dict[Path, str]:
    """Every generated file's expected text: bench/README.md, and each document with blocks."""
    files = {BENCH_README: render_bench_readme()}
    for path in documents():
        if path.exists():
            files[path] = refresh_blocks(path.read_text())
    return files


def stale_files() -> list[Path]:
    return [p for p, text in expected_files().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run python bench/make_readme.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected_files().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
