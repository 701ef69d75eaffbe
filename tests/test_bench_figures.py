"""The benchmarks' step figures from metrics files: what a job's period is."""
import json

import pytest

from bench.time_to_accuracy import step_figures


def _write(path, steps, evals=()):
    records = [{"kind": "step", "step": i, "wall_s": s, "bytes_sent": 100} for i, s in enumerate(steps)]
    records += [{"kind": "eval", "step": e, "time": 0.0, "test_accuracy": 0.5} for e in evals]
    path.write_text("\n".join(json.dumps(r) for r in records))


def test_periodic_step_counts_its_exchange(tmp_path):
    # Hierarchical with T = 4: three local steps of 0.1 s, then one with the exchange (0.9 s).
    _write(tmp_path / "metrics-rank0.jsonl", [1.0] + [0.1, 0.1, 0.1, 0.9] * 3)
    assert step_figures(tmp_path)["step_s"] == pytest.approx(0.3)   # a median would say 0.1


def test_steps_after_an_evaluation_are_left_out(tmp_path):
    # The evaluation after step 4 (0-based 3) lands in the wall time of step 4.
    _write(tmp_path / "metrics-rank0.jsonl", [1.0, 0.2, 0.2, 0.2, 5.0, 0.2, 0.2, 0.2, 0.2], evals=[4])
    assert step_figures(tmp_path)["step_s"] == pytest.approx(0.2)


def test_ranks_are_averaged(tmp_path):
    _write(tmp_path / "metrics-rank0.jsonl", [9.0] + [0.2] * 4)
    _write(tmp_path / "metrics-rank1.jsonl", [9.0] + [0.4] * 4)
    figures = step_figures(tmp_path)
    assert figures["step_s"] == pytest.approx(0.3)
    assert figures["MB_sent/step"] == pytest.approx(100e-6)
