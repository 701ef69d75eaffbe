"""The failure benchmark's bookkeeping (when hosts die, what was trained again, following a metrics file
across restarts) and its DDP peer's DCP resume."""
import argparse
import datetime
import json
import shutil
import time

import pytest

from bench import figures
from bench.peers.ddp_train import complete_checkpoints, train_ddp
from bench.figures import load
from bench.time_to_accuracy import PEER, STRATEGIES, tuned_peer_rank
from bench.train_through_failures import (Failure, MetricsTail, downtime_parts, kill_schedule, planned_runs,
                                          render_downtime, render_train_through_failures, rounds_joined,
                                          steps_redone, summarize, time_to)
from convoy.sim.catalog import PEER_POWERSGD_RANKS
from convoy.utils import timeline
from tests.helpers import run_workers


def test_failures_fall_mid_interval_on_the_last_hosts_first_and_never_on_the_first():
    schedule = kill_schedule(80, 20, 400, 4)
    assert schedule == [Failure(90, 3), Failure(170, 2), Failure(250, 1)]
    assert all(f.step % 20 == 10 for f in schedule)
    # Host 0 serves the rendezvous: however many failures are asked for, it is never killed.
    assert [f.host for f in kill_schedule(10, 4, 1000, 4, most=10)] == [3, 2, 1]
    assert kill_schedule(80, 20, 400, 4, most=1) == [Failure(90, 3)]
    # None at or after the end of the run.
    assert kill_schedule(80, 20, 170, 4) == [Failure(90, 3)]
    # Already mid-interval: the step itself; an odd interval's middle is its floor.
    assert kill_schedule(30, 20, 400, 2) == [Failure(30, 1)]
    assert [f.step for f in kill_schedule(10, 5, 100, 3)] == [12, 22]
    with pytest.raises(ValueError):
        kill_schedule(0, 20, 400, 4)


def test_steps_redone_counts_what_a_later_life_trained_again():
    # Killed after step 9 (10 steps done), resumed from a checkpoint at 5; then after 14, resumed at 15.
    assert steps_redone([list(range(10)), list(range(5, 15)), list(range(15, 20))]) == [5, 0]
    # A life that recorded nothing (killed while starting) re-does nothing; the next is held to what came before.
    assert steps_redone([list(range(10)), [], list(range(4, 8))]) == [0, 6]
    # A life that resumed past what was seen (a step committed but not yet recorded) re-did nothing.
    assert steps_redone([list(range(10)), list(range(11, 12))]) == [0]
    assert steps_redone([list(range(3))]) == []


def test_time_to_a_level_is_the_first_evaluation_at_or_above_it():
    curve = [(10.0, 20, 0.5), (20.0, 40, 0.95), (25.0, 30, 0.96), (30.0, 60, 0.97)]
    assert time_to(curve, 0.95) == (20.0, 40)
    assert time_to(curve, 0.97) == (30.0, 60)
    assert time_to(curve, 0.99) == (None, None)


def test_the_tail_reads_whole_lines_and_sees_a_rewritten_file_as_a_new_life(tmp_path):
    path = tmp_path / "metrics-rank0.jsonl"
    tail = MetricsTail(path, began=100.0)
    assert tail.poll(now=100.5) == []   # not written yet
    first = json.dumps({"kind": "step", "step": 0})
    path.write_text(first + "\n" + '{"kind": "step", "st')   # the second line is half written
    assert tail.poll(now=101.0) == [{"kind": "step", "step": 0, "at": 1.0, "life": 0}]
    with open(path, "a") as f:
        f.write('ep": 1}\n')
    assert tail.poll(now=102.0) == [{"kind": "step", "step": 1, "at": 2.0, "life": 0}]
    assert tail.poll(now=102.5) == []
    path.write_text(json.dumps({"kind": "step", "step": 5}) + "\n")   # a restart opens it with "w"
    assert tail.poll(now=103.0) == [{"kind": "step", "step": 5, "at": 3.0, "life": 1}]


def _ddp(rank: int, world: int, checkpoints: str, out: str) -> None:
    train_ddp(rank, world, steps=12, model="lenet", batch_size=16, checkpoint_dir=checkpoints, checkpoint_every=4,
              out=out)


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step"}


@pytest.mark.timeout(300)
def test_the_ddp_peer_resumed_from_its_dcp_checkpoint_trains_the_same_steps_as_without_the_failure(tmp_path):
    whole = tmp_path / "whole"
    run_workers(_ddp, 2, str(whole), str(tmp_path / "run-whole"))
    # The newest two are kept (steps 4 and 8; none after the last step).
    assert [p.name for p in complete_checkpoints(whole)] == ["step-4", "step-8"]
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "step-8", resumed / "step-8")
    run_workers(_ddp, 2, str(resumed), str(tmp_path / "run-resumed"))
    uninterrupted, after = _losses(tmp_path / "run-whole" / "metrics-rank0.jsonl"), \
        _losses(tmp_path / "run-resumed" / "metrics-rank0.jsonl")
    assert sorted(after) == [8, 9, 10, 11]   # it went on from the checkpoint's step, in the same data order
    # Model, momentum and learning-rate schedule restored: the same losses to the last bit.
    assert after == {step: uninterrupted[step] for step in after}


@pytest.mark.timeout(300)
def test_the_ddp_peer_resumes_its_dcp_checkpoint_on_fewer_workers_as_torchrun_elastic_re_forms_it(tmp_path):
    # --peer-elastic: a checkpoint written by 3 workers, resumed by the 2 that are left.
    whole = tmp_path / "whole"
    run_workers(_ddp, 3, str(whole), str(tmp_path / "run-whole"))
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "step-8", resumed / "step-8")
    run_workers(_ddp, 2, str(resumed), str(tmp_path / "run-resumed"))
    assert sorted(_losses(tmp_path / "run-resumed" / "metrics-rank0.jsonl")) == [8, 9, 10, 11]


def test_the_tuned_peer_is_the_powersgd_rank_soonest_to_the_target_in_the_sweep_s_result():
    rank, why = tuned_peer_rank("vgg_fc", "100mbit")
    data = load("time_to_accuracy_vgg_fc_100mbit")
    plain = {row["strategy"]: row["time_to_target_s"] for row in data["rows"]
             if row["strategy"] in {f"ddp-powersgd-r{r}" for r in PEER_POWERSGD_RANKS} and row["time_to_target_s"]}
    soonest = min(plain, key=plain.get)
    assert f"ddp-powersgd-r{rank}" == soonest and why.startswith(f"{soonest}: the soonest"), (rank, why)
    # The warm-up and fp16 peers are other peers, not ranks of this one, whatever their times.
    assert "warm" not in why and "fp16" not in why
    with pytest.raises(ValueError, match="run bench/time_to_accuracy.py --model vgg_fc --rate no-such-rate"):
        tuned_peer_rank("vgg_fc", "no-such-rate")


def test_a_recovery_s_steps_are_read_from_the_agents_logs_and_the_workers_marks(tmp_path, monkeypatch):
    marks = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(marks))
    kill = time.time()
    log = tmp_path / "agent-h0-0.log"
    stamp = datetime.datetime.fromtimestamp(kill + 0.5)
    torch_time = stamp.strftime("%m%d %H:%M:%S.%f")
    log.write_text(f"E{torch_time} 1 torch/x.py:1] failed (exitcode: 1) local_rank: 0\n"
                   "convoy: error: rank 0: EngineError: a line of the worker's, without a time\n"
                   f"I{torch_time} 1 torch/x.py:2] [default] Starting worker group\n")
    time.sleep(0.6)
    timeline.mark("imported")   # the first mark of this process also records its creation, long before the kill
    parts = downtime_parts([{"wall": kill}], [log], marks)
    assert set(parts[0]) == {"agent saw the worker fail", "workers started", "imported"}, parts
    assert abs(parts[0]["workers started"] - 0.5) < 1e-3 and 0.6 <= parts[0]["imported"] < 60, parts
    # Without the variable a mark writes nothing.
    monkeypatch.delenv(timeline.ENV)
    timeline.mark("first step")
    assert [json.loads(line)["event"] for line in marks.read_text().splitlines()] == ["exec", "imported"]


def _args(**given) -> argparse.Namespace:
    settings = {"no_failures_only": False, "failures_only": False, "convoy_replaced": False, "peer_elastic": False,
                "kill_every": 40,
                "target": 0.97, "also_target": 0.95, "replace_after": 0.0}
    return argparse.Namespace(**{**settings, **given})


def test_convoy_replaced_adds_a_run_with_the_lost_host_replaced_for_each_convoy_strategy_only():
    commands = {"blocktopk": STRATEGIES["blocktopk"], "peer": [PEER, "--powersgd-rank", "4"]}
    schedule = [Failure(50, 2)]
    names = ["blocktopk", "peer"]
    # Without the flag: convoy goes on with its survivors, the peer's host is always replaced.
    assert planned_runs(names, commands, schedule, _args()) == [
        ("blocktopk", [], False), ("blocktopk", schedule, False), ("peer", [], False), ("peer", schedule, True)]
    assert planned_runs(names, commands, schedule, _args(convoy_replaced=True)) == [
        ("blocktopk", [], False), ("blocktopk", schedule, False), ("blocktopk", schedule, True),
        ("peer", [], False), ("peer", schedule, True)]
    assert planned_runs(names, commands, schedule, _args(convoy_replaced=True, failures_only=True)) == [
        ("blocktopk", schedule, False), ("blocktopk", schedule, True), ("peer", schedule, True)]
    # No failures, nothing to replace.
    assert planned_runs(names, commands, schedule, _args(convoy_replaced=True, no_failures_only=True)) == [
        ("blocktopk", [], False), ("peer", [], False)]


def test_peer_elastic_adds_a_peer_run_whose_lost_host_is_not_replaced():
    commands = {"blocktopk": STRATEGIES["blocktopk"], "peer": [PEER, "--powersgd-rank", "4"]}
    schedule = [Failure(50, 2)]
    assert planned_runs(["blocktopk", "peer"], commands, schedule, _args(peer_elastic=True)) == [
        ("blocktopk", [], False), ("blocktopk", schedule, False), ("peer", [], False), ("peer", schedule, True),
        ("peer", schedule, False)]


def test_the_elastic_peer_ends_on_its_survivors_and_is_named_apart_from_the_peer_with_a_spare(
        tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    kills = [{"step": 10, "host": 2, "at": 10.0, "life": 0, "wall": 0.0}]
    failing = _steps(0, range(10), 0.0) + _steps(1, range(0, 20), 20.0)   # back to its checkpoint at step 0
    spare, elastic = (summarize("peer", [Failure(10, 2)], failing, kills, {0: 0, 1: 0, 2: -9}, [], 40.0, _args(),
                                peer=True, replaced=flag) for flag in (True, False))
    assert (spare["hosts_at_end"], spare["clean_exit"]) == (3, False)   # the replaced host must end well
    assert (elastic["hosts_at_end"], elastic["clean_exit"]) == (2, True)   # the lost host is not waited for
    (tmp_path / "probe.json").write_text(json.dumps({"settings": {"target": 0.97, "also_target": 0.95},
                                                     "rows": [spare, elastic]}))
    lines = render_train_through_failures("probe").splitlines()
    assert lines[2].startswith("| peer | DDP + DCP, torchrun restarts |")
    assert lines[3].startswith("| peer (elastic) | DDP + DCP, torchrun elastic, on the survivors |")


def _steps(life: int, steps, start: float) -> list[dict]:
    return [{"kind": "step", "step": s, "at": start + i, "life": life} for i, s in enumerate(steps)]


def test_a_replaced_run_ends_on_every_host_and_a_second_restart_s_time_down_is_its_kill_s():
    # Killed after step 9 at t=10; the survivors resume at t=20 (life 1); the replacement, late, asks for
    # another round: life 1's last record at t=22, life 2's first at t=30.
    records = _steps(0, range(10), 0.0) + _steps(1, range(10, 13), 20.0) + _steps(2, range(12, 20), 30.0)
    kills = [{"step": 10, "host": 2, "at": 10.0, "life": 0, "wall": 0.0}]
    codes = {0: 0, 1: 0, 2: 0}   # host 2: its replacement's agent
    row = summarize("blocktopk", [Failure(10, 2)], records, kills, codes, [], 40.0, _args(), peer=False,
                    replaced=True)
    assert row["replaced"] and row["hosts_at_end"] == 3 and row["restarts"] == 2
    assert row["down_per_restart_s"] == [10.0 + 8.0] and row["down_s"] == 18.0
    assert row["redone_per_restart"] == [0, 1] and row["steps_redone"] == 1
    # On the survivors the killed host's code is not the job's (its agent was SIGKILLed).
    shrunk = summarize("blocktopk", [Failure(10, 2)], records[:13], kills, {0: 0, 1: 0, 2: -9}, [], 40.0, _args(),
                       peer=False)
    assert not shrunk["replaced"] and shrunk["hosts_at_end"] == 2 and shrunk["clean_exit"]
    assert shrunk["down_per_restart_s"] == [10.0]


def _agent_log(path, joins: list[tuple[float, int, int]]) -> None:
    """An agent's log at INFO with a "Rendezvous complete" result for each (time, port, world)."""
    lines = []
    for t, port, world in joins:
        stamp = datetime.datetime.fromtimestamp(t).strftime("%m%d %H:%M:%S.%f")
        head = f"I{stamp} 7 torch/distributed/elastic/agent/server/api.py:553] "
        lines += [head + "[default] Rendezvous complete for workers. Result:", head + "  restart_count=0",
                  head + "  master_addr=198.18.0.1", head + f"  master_port={port}", head + "  group_rank=0",
                  head + f"  group_world_size={world}", head]
    path.write_text("\n".join(lines) + "\n")


def test_the_rounds_after_a_kill_say_whether_the_replacement_joined_the_survivors_round(tmp_path):
    t0 = time.time() - 100   # the first round, before the kill
    kill = {"wall": t0 + 50}
    logs = [tmp_path / "agent-h0-0.log", tmp_path / "agent-h1-1.log", tmp_path / "agent-h1-2.log"]
    # In time: the replacement (host 1's second agent) in the survivors' round.
    _agent_log(logs[0], [(t0, 100, 2), (t0 + 56, 101, 2)])
    _agent_log(logs[1], [(t0 + 0.1, 100, 2)])
    _agent_log(logs[2], [(t0 + 56.5, 101, 2)])
    assert rounds_joined([kill], logs) == [[{"world": 2, "hosts": [0, 1], "at": pytest.approx(6.5, abs=1e-3)}]]
    # Late: host 0 alone, then a second round with the replacement.
    _agent_log(logs[0], [(t0, 100, 2), (t0 + 56, 101, 1), (t0 + 70, 102, 2)])
    _agent_log(logs[2], [(t0 + 70.2, 102, 2)])
    rounds = rounds_joined([kill], logs)[0]
    assert [(r["world"], r["hosts"]) for r in rounds] == [(1, [0]), (2, [0, 1])]


def test_the_tables_name_the_replaced_rows_and_compare_them_with_the_same_strategy_without_failures(
        tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    calm = summarize("blocktopk", [], _steps(0, range(20), 0.0), [], {0: 0, 1: 0, 2: 0}, [], 20.0, _args(),
                     peer=False)
    kills = [{"step": 10, "host": 2, "at": 10.0, "life": 0, "wall": 0.0}]
    failing = _steps(0, range(10), 0.0) + _steps(1, range(10, 20), 20.0)
    shrunk, replaced = (summarize("blocktopk", [Failure(10, 2)], failing, kills, {0: 0, 1: 0, 2: 0}, [], 30.0,
                                  _args(), peer=False, replaced=flag) for flag in (False, True))
    for row, at in ((calm, 10.0), (shrunk, 20.0), (replaced, 25.0)):   # evaluations: 97% at ``at``
        row["curve"] = [(at, 20, 0.97)]
        row["time_to_target_s"] = at
    replaced["downtime_parts"] = [{"agent saw the worker fail": 0.2, "first step recorded": 10.0}]
    replaced["rounds_after_kill"] = [[{"world": 3, "hosts": [0, 1, 2], "at": 6.5}]]
    (tmp_path / "probe.json").write_text(json.dumps({"settings": {"target": 0.97, "also_target": 0.95},
                                                     "rows": [calm, shrunk, replaced]}))
    lines = render_train_through_failures("probe").splitlines()
    assert lines[2].startswith("| blocktopk | convoy, elastic | none |")
    assert lines[3].startswith("| blocktopk | convoy, elastic, on the survivors |") and "| 2.00x |" in lines[3]
    assert lines[4].startswith("| blocktopk (host replaced) | convoy, elastic, lost host replaced at once |")
    assert "| 2.50x |" in lines[4] and lines[4].endswith("| 3 | yes |")
    steps = render_downtime("probe").splitlines()
    assert steps[0].endswith("| world re-formed (its hosts), when |")
    assert steps[2].startswith("| blocktopk (host replaced) | 1 |") and "3 (hosts 0, 1, 2) at 6.50 s" in steps[2]
