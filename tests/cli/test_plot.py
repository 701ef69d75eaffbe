import argparse
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from convoy.cli.plot import PLOT_FILES, add_parser, plot_run, robust_top
from convoy.errors import UsageError


def write_run(run_dir: Path, rank: int = 0, n_steps: int = 40) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "summary.json").write_text("{}")
    lines = []
    t = 0.0
    for s in range(1, n_steps + 1):
        compute, wait = 0.05 + 0.001 * (s % 3), 0.02 + 0.002 * (s % 5)
        t += compute + wait
        lines.append({"kind": "step", "step": s, "epoch": (s - 1) // 20, "loss": 2.3 / s ** 0.5,
                      "train_accuracy": min(1.0, 0.1 + s / 50), "time": t, "wall_s": compute + wait,
                      "wait_s": wait, "compute_s": compute, "bytes_sent": 1_000_000 + 1000 * s,
                      "bytes_received": 1_200_000 - 1000 * s})
        if s % (n_steps // 3) == 0 and s // (n_steps // 3) <= 3:
            lines.append({"kind": "eval", "step": s, "time": t + 0.1,
                          "test_accuracy": 0.2 * s / (n_steps // 3), "test_loss": 2.0 / s ** 0.5})
    path = run_dir / f"metrics-rank{rank}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def check_pngs(out_dir: Path, written):
    assert sorted(p.name for p in written) == sorted(PLOT_FILES)
    for name in PLOT_FILES:
        data = (out_dir / name).read_bytes()
        assert data.startswith(b"\x89PNG")
        assert len(data) > 5000


def test_plot_writes_four_pngs(tmp_path):
    write_run(tmp_path)
    written = plot_run(tmp_path)
    assert all(p.parent == tmp_path for p in written)
    check_pngs(tmp_path, written)


def test_plot_out_elsewhere_and_rank(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, rank=0)
    write_run(run_dir, rank=1)
    out = tmp_path / "charts" / "nested"
    written = plot_run(run_dir, out, rank=1)
    check_pngs(out, written)
    assert not any((run_dir / n).exists() for n in PLOT_FILES)


def test_missing_dir(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        plot_run(tmp_path / "nope")


def test_not_a_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        plot_run(f)


def test_dir_without_metrics(tmp_path):
    with pytest.raises(UsageError, match="metrics-rank0.jsonl") as e:
        plot_run(tmp_path)
    assert "\n" not in str(e.value)


def test_wrong_rank_lists_existing(tmp_path):
    write_run(tmp_path, rank=1)
    write_run(tmp_path, rank=2)
    with pytest.raises(UsageError, match=r"metrics-rank0\.jsonl.*1, 2"):
        plot_run(tmp_path, rank=0)


def test_malformed_line(tmp_path):
    path = write_run(tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(4, '{"kind": "step", "step": ')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError, match=r"metrics-rank0\.jsonl.*line 5") as e:
        plot_run(tmp_path)
    assert "\n" not in str(e.value)


def test_no_step_records(tmp_path):
    path = tmp_path / "metrics-rank0.jsonl"
    path.write_text(json.dumps({"kind": "eval", "step": 1, "time": 1.0,
                                "test_accuracy": 0.5, "test_loss": 1.0}) + "\n")
    with pytest.raises(UsageError, match="no step records"):
        plot_run(tmp_path)


def test_run_via_argparse(tmp_path, capsys):
    write_run(tmp_path)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["plot", str(tmp_path)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sorted(Path(p).name for p in printed) == sorted(PLOT_FILES)
    check_pngs(tmp_path, [Path(p) for p in printed])


def test_help_explains_output(capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["plot", "--help"])
    out = capsys.readouterr().out
    for name in PLOT_FILES:
        assert name in out
    assert "--out" in out and "--rank" in out


@settings(max_examples=60, deadline=None)
@given(typical=st.lists(st.floats(0.001, 1.0), min_size=20, max_size=300), slow=st.floats(10.0, 1000.0))
def test_a_slow_first_step_does_not_set_the_step_time_scale(typical, slow):
    top = robust_top([slow] + typical)
    assert top <= max(typical)                      # the outlier never stretches the axis
    assert top >= sorted(typical)[len(typical) // 2]  # yet most steps stay on the chart
