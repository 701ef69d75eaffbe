"""What helps a user at the command line: suggestions, grouped help, sectioned config files, devices, own models."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from convoy.errors import UsageError
from convoy.train.config import SECTIONS, TrainConfig, build_config, config_settings, load_toml, settings_by_name
from tests.helpers import convoy_in_process, one_line_error

FLAGS = [s.flag for s in config_settings()]


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
    for setting in config_settings():
        at = re.search(rf"^  {setting.flag}\b", result.stdout, re.M).start()
        group = max((start, name) for name, start in titles.items() if start < at)[1]
        assert group == setting.section, setting.name
    assert "(default: 0.9)" in result.stdout       # --momentum's default is shown


def test_sectioned_and_flat_config_files_are_the_same_settings(tmp_path):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text("steps = 3\n[optim]\nlr = 0.1\nweight-decay = 0.0\n[data]\nbatch_size = 8\n"
                      "[compress]\ncompress = 'topk'\n")
    flat.write_text("steps = 3\nlr = 0.1\nweight_decay = 0.0\nbatch_size = 8\ncompress = 'topk'\n")
    assert load_toml(str(nested)) == load_toml(str(flat))
    assert build_config(load_toml(str(nested)), {}).optim.lr == 0.1
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[data]\nlr = 0.1\n")
    with pytest.raises(UsageError, match=r"'lr' belongs in \[optim\], not \[data\]"):
        load_toml(str(misplaced))
    typo = tmp_path / "typo.toml"
    typo.write_text("[optim]\nlrr = 0.1\n")
    with pytest.raises(UsageError, match="did you mean lr"):
        load_toml(str(typo))


def test_a_section_table_takes_its_fields_own_names_and_refuses_a_setting_given_twice(tmp_path):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text("[model]\nname = 'vgg_fc'\n[sync]\nstrategy = 'hierarchical'\n"
                      "[checkpoint]\ndir = 'ckpt'\nfull-every = 3\nevery = 5\n")
    flat.write_text("model = 'vgg_fc'\nsync = 'hierarchical'\ncheckpoint_dir = 'ckpt'\n"
                    "checkpoint_full_every = 3\ncheckpoint-every = 5\n")
    assert load_toml(str(nested)) == load_toml(str(flat))
    twice = tmp_path / "twice.toml"
    twice.write_text("lr = 0.1\n[optim]\nlr = 0.2\n")
    with pytest.raises(UsageError, match="lr is given twice"):
        load_toml(str(twice))
    typo = tmp_path / "typo.toml"
    typo.write_text("[checkpoint]\ndri = 'ckpt'\n")
    with pytest.raises(UsageError, match=r"unknown key \[checkpoint\] 'dri'; valid keys: dir, every.*did you mean dir"):
        load_toml(str(typo))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(list(value) if isinstance(value, tuple) else value)   # strings, numbers, lists


@pytest.mark.parametrize("flags", [
    {},
    {"model": "vgg_fc", "sync": "ps", "nproc": 3, "servers": 1, "priority": "fifo", "logger": ("csv",),
     "progress": False},
    {"compress": "blocktopk", "block_fraction": 0.1, "checkpoint_dir": "ckpt", "checkpoint_every": "auto",
     "resume": False, "steps": 7, "optimizer": "adam", "lr": 1},
    {"nproc": 4, "parallel": "hybrid", "conv_workers": 3, "fc_workers": 1, "sub_batches": 2, "data_dir": "d"},
])
def test_a_run_folders_config_json_as_toml_is_the_same_config(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = build_config({}, flags)
    saved = json.loads(json.dumps(config.to_dict()))          # what config.json holds
    assert TrainConfig.from_dict(saved).validate() == config  # what a worker reads
    toml = tmp_path / "config.toml"
    toml.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {_toml_value(value)}\n"
                                                      for key, value in values.items() if value is not None)
                            for section, values in saved.items()))
    assert build_config(load_toml(str(toml)), {}) == config


def test_every_setting_has_one_flat_name_and_from_flat_knows_them_all():
    every = config_settings()
    assert len(settings_by_name()) == len(every) == len({(s.section, s.attr) for s in every})
    config = TrainConfig.from_flat(**{s.name: s.default for s in every})
    assert config == TrainConfig()
    with pytest.raises(TypeError, match="did you mean batch_size"):
        TrainConfig.from_flat(batch_sise=8)


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
