"""The failure benchmark's bookkeeping (when hosts die, what was trained again, following a metrics file
across restarts) and its DDP peer's DCP resume."""
import datetime
import json
import shutil
import time

import pytest

from bench.peers.ddp_train import complete_checkpoints, train_ddp
from bench.figures import load
from bench.train_through_failures import (Failure, MetricsTail, downtime_parts, kill_schedule, steps_redone, time_to,
                                          tuned_peer_rank)
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


def test_the_tuned_peer_is_the_powersgd_rank_soonest_to_the_target_in_the_sweep_s_result():
    rank, why = tuned_peer_rank("vgg_fc", "100mbit")
    data = load("time_to_accuracy_vgg_fc_100mbit")
    plain = {row["strategy"]: row["time_to_target_s"] for row in data["rows"]
             if row["strategy"] in {f"ddp-powersgd-r{r}" for r in (1, 2, 4, 8)} and row["time_to_target_s"]}
    soonest = min(plain, key=plain.get)
    assert f"ddp-powersgd-r{rank}" == soonest and why.startswith(f"{soonest}: the soonest"), (rank, why)
    # The warm-up and fp16 peers are other peers, not ranks of this one, whatever their times.
    assert "warm" not in why and "fp16" not in why
    with pytest.raises(ValueError, match="--peer-rank"):
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
