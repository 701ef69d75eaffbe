"""What helps a user at the command line: suggestions, grouped help, sectioned config files, devices, own models."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from convoy.errors import UsageError
from convoy.train.config import SECTIONS, build_config, config_fields, load_toml
from tests.helpers import convoy_in_process, one_line_error

FLAGS = ["--" + f.name.replace("_", "-") for f in config_fields()]


@pytest.mark.parametrize("args, suggestion", [
    (["train", "--modle", "vgg_fc"], "did you mean --model?"),
    (["train", "--stpes=3"], "did you mean --steps?"),
    (["train", "--model", "vgg_f"], "did you mean vgg_fc?"),
    (["train", "--compress", "blocktop"], "did you mean blocktopk?"),
    (["trian"], "did you mean train?"),
])
def test_a_mistyped_flag_or_choice_gets_one_line_naming_the_right_one(args, suggestion):
    assert one_line_error(convoy_in_process(*args)).endswith(suggestion)


@settings(max_examples=40, deadline=None)
@given(flag=st.sampled_from(FLAGS), data=st.data())
def test_any_one_letter_typo_of_a_flag_is_one_line_and_suggests_only_real_flags(flag, data):
    at = data.draw(st.integers(2, len(flag) - 1))
    typo = flag[:at] + flag[at + 1:]          # one letter dropped
    if typo in FLAGS or any(f.startswith(typo) for f in FLAGS + ["--config", "--help"]):
        return                                # argparse accepts unique prefixes
    line = one_line_error(convoy_in_process("train", typo, "1"))
    suggested = re.search(r"did you mean (\S+)\?$", line)
    assert suggested is None or suggested.group(1) in FLAGS + ["--config", "--help"]


def test_help_groups_every_option_under_its_section():
    result = convoy_in_process("train", "--help")
    assert result.returncode == 0
    titles = {name: result.stdout.index(f"\n{name}:\n") for name in SECTIONS}
    for field in config_fields():
        at = re.search(rf"^  --{field.name.replace('_', '-')}\b", result.stdout, re.M).start()
        group = max((start, name) for name, start in titles.items() if start < at)[1]
        assert group == field.metadata["section"], field.name
    assert "(default: 0.9)" in result.stdout       # --momentum's default is shown


def test_sectioned_and_flat_config_files_are_the_same_settings(tmp_path):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text("steps = 3\n[optim]\nlr = 0.1\nweight-decay = 0.0\n[data]\nbatch_size = 8\n"
                      "[compress]\ncompress = 'topk'\n")
    flat.write_text("steps = 3\nlr = 0.1\nweight_decay = 0.0\nbatch_size = 8\ncompress = 'topk'\n")
    assert load_toml(str(nested)) == load_toml(str(flat))
    assert build_config(load_toml(str(nested)), {}).lr == 0.1
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[data]\nlr = 0.1\n")
    with pytest.raises(UsageError, match=r"'lr' belongs in \[optim\], not \[data\]"):
        load_toml(str(misplaced))
    typo = tmp_path / "typo.toml"
    typo.write_text("[optim]\nlrr = 0.1\n")
    with pytest.raises(UsageError, match="did you mean lr"):
        load_toml(str(typo))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_is_refused_in_one_line_without_a_gpu():
    assert "--device cuda" in one_line_error(convoy_in_process("train", "--device", "cuda"))


@pytest.mark.timeout(120)
def test_a_model_file_and_a_dataset_module_in_the_current_directory_train(tmp_path):
    (tmp_path / "nets").mkdir()   # a folder of its own: importing the file puts only nets/ on sys.path
    (tmp_path / "nets" / "tiny_net.py").write_text(textwrap.dedent("""
        from torch import nn

        def build(in_channels, num_classes, image_size):
            return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size[0] * image_size[1], num_classes))
    """))
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "__init__.py").write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset

        def load():
            torch.manual_seed(0)
            return TensorDataset(torch.randn(64, 1, 4, 4), torch.arange(64) % 3)
    """))
    # The console script, unlike python -m, does not put the current directory on sys.path.
    script = shutil.which("convoy")
    command = [script] if script else [sys.executable, "-m", "convoy"]
    result = subprocess.run([*command, "train", "--model", "nets/tiny_net.py:build", "--dataset", "blobs:load",
                             "--nproc", "1", "--steps", "2", "--batch-size", "8", "--no-progress",
                             "--out", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "model.pt").exists()
    state = torch.load(tmp_path / "run" / "model.pt")["model"]
    assert state["1.weight"].shape == (3, 16)        # the factory got the dataset's channels, size and classes


def test_the_final_line_names_rank_0s_bytes_when_they_differ_from_the_mean():
    from convoy.train.loop import RunSummary

    # ps with one server and two workers: the server (rank 0, the progress bar's) sends half again the mean.
    uneven = RunSummary(30, 1.0, 0.5, 1.0, bytes_sent_per_worker=13.26e6, run_dir="r", bytes_sent_rank0=19.89e6)
    assert "13.26 MB sent per worker on average (rank 0: 19.89 MB, as on the progress bar)" in uneven.line()
    even = RunSummary(30, 1.0, 0.5, 1.0, bytes_sent_per_worker=6.63e6, run_dir="r", bytes_sent_rank0=6.63e6)
    assert "6.63 MB sent per worker on average;" in even.line()


@pytest.mark.parametrize("uplinks, noise, warned", [
    ((1000.0, 1100.0, 1000.0, 1100.0), 0.5, True),    # a 9% gap where a node's tries differed by 50%
    ((100.0, 100.0, 1000.0, 1000.0), 0.2, False),     # a 10x gap is a real difference
    ((1000.0, 1100.0, 1000.0, 1100.0), 0.0, False),   # values from a file are exact: any gap is real
])
def test_profile_nodes_warns_when_clusters_differ_by_less_than_the_noise(uplinks, noise, warned):
    from convoy.cluster import DEFAULT_WEIGHTS, NodeProfile, make_plan

    profiles = [NodeProfile(r, "h", 3000.0, 16.0, 0.0, 0.0, 500.0, uplink, noise={"uplink_mbps": noise})
                for r, uplink in enumerate(uplinks)]
    plan = make_plan(profiles, DEFAULT_WEIGHTS, clusters=2)
    assert len(plan.clusters) == 2
    assert (plan.noise_warning() is not None) == warned
    assert plan.as_json()["noise_warning"] == plan.noise_warning()
