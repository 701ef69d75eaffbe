"""The benchmarks' figures from metrics and result files: a job's period, accuracy at a budget."""
import json
import re

import pytest

from bench.accuracy_at_budget import accuracy_at, budget_rows
from bench.common import launcher
from bench.steps_across_seeds import default_strategies, medians, render_steps_across_seeds
from bench.time_to_accuracy import tuned_peer_rank
from bench.time_to_accuracy import step_figures


def _write(path, steps, evals=()):
    records = [{"kind": "step", "step": i, "wall_s": s, "bytes_sent": 100} for i, s in enumerate(steps)]
    records += [{"kind": "eval", "step": e, "time": 0.0, "test_accuracy": 0.5} for e in evals]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))   # as MetricsWriter writes them


def test_periodic_step_counts_its_exchange(tmp_path):
    # Hierarchical with T = 4: three local steps of 0.1 s, then one with the exchange (0.9 s).
    _write(tmp_path / "metrics-rank0.jsonl", [1.0] + [0.1, 0.1, 0.1, 0.9] * 3)
    assert step_figures(tmp_path)["step_s"] == pytest.approx(0.3)   # a median would say 0.1


def test_steps_after_an_evaluation_are_left_out(tmp_path):
    # The evaluation after step 4 (0-based 3) lands in the wall time of step 4.
    _write(tmp_path / "metrics-rank0.jsonl", [1.0, 0.2, 0.2, 0.2, 5.0, 0.2, 0.2, 0.2, 0.2], evals=[4])
    assert step_figures(tmp_path)["step_s"] == pytest.approx(0.2)


def test_an_unfinished_last_line_is_left_out(tmp_path):
    # A rank stopped at the suite's time limit may end its file mid-line.
    _write(tmp_path / "metrics-rank0.jsonl", [1.0, 0.2, 0.2, 0.2, 0.2])
    with open(tmp_path / "metrics-rank0.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 5, "wa')
    assert step_figures(tmp_path)["step_s"] == pytest.approx(0.2)


def test_a_run_stopped_in_its_warm_up_has_no_step(tmp_path):
    _write(tmp_path / "metrics-rank0.jsonl", [1.0])
    assert step_figures(tmp_path) == {"step_s": None, "MB_sent/step": None}


def test_ranks_are_averaged(tmp_path):
    _write(tmp_path / "metrics-rank0.jsonl", [9.0] + [0.2] * 4)
    _write(tmp_path / "metrics-rank1.jsonl", [9.0] + [0.4] * 4)
    figures = step_figures(tmp_path)
    assert figures["step_s"] == pytest.approx(0.3)
    assert figures["MB_sent/step"] == pytest.approx(100e-6)


def test_a_colocated_servers_replies_count_as_sent(tmp_path):
    records = [{"kind": "step", "step": i, "wall_s": 1.0, "bytes_sent": 100, "server_bytes_sent": 60} for i in range(5)]
    (tmp_path / "metrics-rank0.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert step_figures(tmp_path)["MB_sent/step"] == pytest.approx(160e-6)


def test_the_launcher_names_the_hosts_congestion_control_only_when_asked():
    assert launcher(["train"], 4, "100mbit", tcp_congestion="cubic")[-4:] == ["--tcp-congestion", "cubic", "--", "train"]
    assert "--tcp-congestion" not in launcher(["train"], 4, "100mbit")


def _run(strategy, curve, hit):
    return {"model": "m", "rate": "1gbit", "strategy": strategy, "curve": curve, "time_to_target_s": hit}


def test_accuracy_at_a_budget_is_the_last_evaluation_before_it():
    curve = [(10.0, 0.5), (20.0, 0.8), (30.0, 0.9)]
    assert accuracy_at(curve, 5.0) is None
    assert accuracy_at(curve, 20.0) == 0.8
    assert accuracy_at(curve, 29.9) == 0.8


def test_the_default_budget_is_the_settings_earliest_hit():
    rows = [_run("slow", [(10.0, 0.6), (40.0, 0.9), (80.0, 0.97)], 80.0),
            _run("fast", [(20.0, 0.7), (45.0, 0.98)], 45.0),
            _run("failed", [], None)]
    table = budget_rows(rows)
    assert [(r["strategy"], r["budget_s"], r["accuracy_at_budget"]) for r in table] == [
        ("fast", 45.0, 0.98), ("slow", 45.0, 0.9)]
    assert all(r["note"] == "" for r in table)


def test_a_run_that_stopped_before_a_longer_budget_is_marked():
    rows = [_run("fast", [(20.0, 0.7), (45.0, 0.98)], 45.0), _run("never", [(30.0, 0.5), (90.0, 0.8)], None)]
    marked = {r["strategy"]: r["note"] for r in budget_rows(rows, budget_s=100.0)}
    assert marked["fast"] and not marked["never"]


def test_without_a_hit_a_budget_must_be_given():
    with pytest.raises(ValueError, match="no run of m at 1gbit reached the target"):
        budget_rows([_run("never", [(30.0, 0.5)], None)])


def test_suite_steps_become_a_plan_steps_file(tmp_path):
    from bench.plan_time_to_target import write_steps_file
    from convoy.sim.convergence import load_convergence

    data = {"settings": {"batch_size": 16, "hosts": 4, "target": 0.97, "warmup_steps": 20}}
    rows = [{"strategy": "dense", "steps_to_target": 50}, {"strategy": "hierarchical", "steps_to_target": 75},
            {"strategy": "blocktopk", "steps_to_target": None}, {"strategy": "powersgd", "steps_to_target": 175}]
    convergence = load_convergence(write_steps_file("resnet18", "1gbit", data, rows, tmp_path), 4)
    assert convergence.steps == {"allreduce": 50, "hierarchical K=2 T=4": 75, "allreduce blocktopk 0.01": None}
    assert (convergence.model, convergence.nodes, convergence.warmup_steps) == ("resnet18", 4, 20)
    assert "bench/two_racks.toml" in convergence.flags["hierarchical K=2 T=4"]   # relative to the repository


# The documentation's figures come from bench/results/*.json through bench/make_readme.py.

def test_bench_readme_and_the_docs_figure_blocks_are_generated():
    from bench.make_readme import ROOT, stale_files
    stale = [str(p.relative_to(ROOT)) for p in stale_files()]
    assert stale == [], f"typed or outdated figures in {stale}: run python bench/make_readme.py"


def test_a_figure_typed_into_a_block_is_replaced_by_the_measured_one():
    from bench.make_readme import refresh_blocks, render_block
    typed = "before\n<!-- bench:default_job -->\n| seed | 99.9% |\n<!-- /bench:default_job -->\nafter\n"
    assert refresh_blocks(typed) == \
        f"before\n<!-- bench:default_job -->\n{render_block('default_job')}<!-- /bench:default_job -->\nafter\n"


def test_an_unknown_block_is_refused():
    from bench.make_readme import refresh_blocks
    with pytest.raises(ValueError, match="unknown figure block 'no_such'"):
        refresh_blocks("<!-- bench:no_such -->\nx\n<!-- /bench:no_such -->")


# A measured figure: a number with a unit of time, bytes or share, or a ratio such as 3.6x.
_MEASURED = re.compile(r"\d(\.\d+)?(x| ?(ms|s|%|MB|kB))( |\||,|$)")


def test_no_table_outside_a_generated_block_holds_a_measured_figure():
    from bench.make_readme import MARKER, documents
    for path in documents():
        text = MARKER.sub("", path.read_text())
        typed = [line for line in text.splitlines() if line.startswith("|") and _MEASURED.search(line)]
        assert typed == [], f"{path.name}: measured figures typed into a table: {typed[:3]}"


def test_a_result_file_no_block_reads_still_gets_a_table(tmp_path, monkeypatch):
    import bench.figures as figures
    import bench.make_readme as make_readme
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    (tmp_path / "new_bench.json").write_text(json.dumps(
        {"machine": {"date": "2026-01-01 00:00:00", "commit": "abc", "cpus": 2, "torch": "t"},
         "settings": {"steps": 3}, "rows": [{"mode": "a", "step_s": 0.25, "curve": [[1, 2]]}]}))
    text = make_readme.render_bench_readme()
    assert "### new_bench" in text and "| mode | step_s |" in text and "| a | 0.25 |" in text


def test_a_renderer_that_fails_fails_the_check_naming_its_block(tmp_path, monkeypatch, capsys):
    # default_job.json as a benchmark that renamed its "seed" column would write it.
    import bench.figures as figures
    from bench.make_readme import main
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    (tmp_path / "default_job.json").write_text(json.dumps(
        {"machine": {"date": "2026-01-01 00:00:00", "commit": "abc", "cpus": 2, "torch": "t"}, "settings": {},
         "rows": [{"run_seed": 0, "test_accuracy": 0.97, "seconds": 100.0, "steps": 300, "meets_target": True}]}))
    assert main(["--check"]) == 1
    error = capsys.readouterr().err
    assert "figure block 'default_job' (bench.default_job.render_default_job)" in error
    assert "KeyError: 'seed'" in error


def test_every_block_is_drawn_by_the_benchmark_module_that_lists_it():
    # The renderer lives beside its bench: a render_* function of the module whose BLOCKS hold the block.
    import importlib

    from bench.make_readme import BENCHES, blocks
    for block in blocks().values():
        func = getattr(block.render, "func", block.render)   # a functools.partial names its function
        assert func.__name__.startswith("render_"), block.name
        assert func.__module__ in {f"bench.{m}" for m in BENCHES}, block.name
        assert block in importlib.import_module(func.__module__).BLOCKS, block.name


_MACHINE = {"date": "2026-01-01 00:00:00", "commit": "abc", "cpus": 2, "torch": "t"}
_DEFAULT_JOB_ROWS = [{"seed": 0, "test_accuracy": 0.97, "seconds": 100.0, "steps": 300, "meets_target": True}]


def test_a_block_prints_the_command_its_result_file_recorded_and_says_when_there_is_none(tmp_path, monkeypatch):
    import bench.figures as figures
    from bench.make_readme import render_block
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    path = tmp_path / "default_job.json"
    path.write_text(json.dumps({"machine": {**_MACHINE, "command": "python bench/default_job.py --seeds 7"},
                                "settings": {}, "rows": _DEFAULT_JOB_ROWS}))
    assert "\nCommand: `python bench/default_job.py --seeds 7`. Compared with:" in render_block("default_job")
    path.write_text(json.dumps({"machine": _MACHINE, "settings": {}, "rows": _DEFAULT_JOB_ROWS}))
    text = render_block("default_job")
    assert "\nCommand: not recorded: measured before the benchmarks recorded their command line; " \
           "to measure again: `python bench/default_job.py`. Compared with:" in text


def test_a_result_file_records_the_command_that_wrote_it(tmp_path, monkeypatch):
    import sys

    import bench.common as common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(common.Path(common.__file__).parent / "x.py"), "--steps", "3", "a b"])
    path = common.save("x", {"steps": 3}, [{"mode": "a"}], ["mode"])
    assert json.loads(path.read_text())["machine"]["command"] == "python bench/x.py --steps 3 'a b'"


def test_a_seed_that_never_reached_the_target_counts_as_the_most_steps():
    rows = [{"strategy": "a", "seed": seed, "steps_to_0.97": steps}
            for seed, steps in enumerate([240, None, 200, 260, None])]
    median, = medians(rows, [0.97])
    assert median["steps_to_0.97"] == 260 and median["seeds_reaching_0.97"] == 3
    rows[3]["steps_to_0.97"] = None   # most seeds never got there: neither does the median
    assert medians(rows, [0.97])[0]["steps_to_0.97"] is None


def test_medians_are_per_strategy_and_take_the_lower_middle_of_an_even_count():
    rows = [{"strategy": name, "seed": seed, "steps_to_0.95": steps}
            for name, runs in (("a", [100, 140]), ("b", [180, 160, 120])) for seed, steps in enumerate(runs)]
    assert [(m["strategy"], m["steps_to_0.95"]) for m in medians(rows, [0.95])] == [("a", 100), ("b", 160)]


def test_runs_at_other_seeds_render_as_one_table_with_the_median_over_all_of_them(tmp_path, monkeypatch):
    from bench import figures
    monkeypatch.setattr(figures, "RESULTS", tmp_path)

    def run(name, steps_by_seed):
        rows = [{"strategy": "a", "seed": seed, "steps_to_0.95": steps} for seed, steps in steps_by_seed.items()]
        stored = medians(rows, [0.95])   # each run stores the median of its own seeds only
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows + stored}))
    run("first", {0: 100, 1: 100, 2: 300})
    run("more", {3: 300, 4: 300})
    last = render_steps_across_seeds("first", "more").splitlines()[-1]
    assert [c.strip() for c in last.strip("|").split("|")] == \
        ["a", "95%", "100", "100", "300", "300", "300", "300 (5 of 5 reached it)"]


def test_the_seeds_default_peer_is_the_sweep_s_best_rank_for_the_model(monkeypatch):
    for model in ("vgg_fc", "resnet18"):
        peer, convoy = default_strategies(model)
        assert peer == f"ddp-powersgd-r{tuned_peer_rank(model, '100mbit')[0]}" and convoy == "convoy-powersgd-r4"
    # Read from the sweep's result, not typed: a sweep where rank 2 was soonest makes rank 2 the peer.
    from bench import time_to_accuracy

    def row(strategy, seconds_):
        return {"strategy": strategy, "time_to_target_s": seconds_}
    sweep = {"settings": {"target": 0.97}, "rows": [row("ddp-powersgd-r2", 30.0), row("ddp-powersgd-r4", 40.0),
                                                     row("ddp-powersgd-r8", None), row("convoy-powersgd-r4", 20.0)]}
    monkeypatch.setattr(time_to_accuracy, "load", lambda name: sweep)
    assert default_strategies("vgg_fc")[0] == "ddp-powersgd-r2"


def test_the_headline_compares_with_the_soonest_tuned_peer_where_the_suite_ran_them(tmp_path, monkeypatch):
    from bench import figures, suite
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    monkeypatch.setattr(suite, "SUITE_FILES", {("vgg_fc", "100mbit"): ("one_run",)})

    def row(strategy, seconds_):
        return {"model": "vgg_fc", "rate": "100mbit", "strategy": strategy, "time_to_target_s": seconds_,
                "final_accuracy": 0.97}
    rows = [row("ddp", 100.0), row("ddp-powersgd-r4", 60.0), row("ddp-powersgd-r16", 40.0), row("convoy", 20.0)]
    (tmp_path / "one_run.json").write_text(json.dumps({"rows": rows}))
    table = suite.render_headline()
    assert "vs the best tuned peer (ddp-powersgd-r16)" in table and "| convoy | 20 s, 2.00x |" in table
    # A suite from before the tuned peers keeps torch DDP as the reference.
    (tmp_path / "one_run.json").write_text(json.dumps({"rows": [rows[0], rows[3]]}))
    assert "| convoy | 20 s, 5.00x |" in suite.render_headline()
    # A run stopped at the suite's time limit says how long it was given.
    stopped = {**row("ps-fifo", None), "final_accuracy": 0.9, "time_limit_s": 300.0}
    (tmp_path / "one_run.json").write_text(json.dumps({"rows": [*rows, stopped]}))
    assert "| ps-fifo | not reached in 300 s (90.0%) |" in suite.render_headline()
