"""Built-in models, user factories, the conv/FC split, and how far vgg_fc trains in 300 steps (slow)."""
from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from torch import nn

from convoy.errors import UsageError
from convoy.models import MODEL_NAMES, build_model, split_point
from tests.helpers import convoy_in_process

BATCH = 2


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    """One 1x32x32 build of each built-in, shared to keep the suite fast."""
    torch.manual_seed(0)
    return {name: build_model(name).eval() for name in MODEL_NAMES}


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(("channels", "size"), [(1, 32), (3, 32), (1, 28)])
def test_output_shape(name: str, channels: int, size: int) -> None:
    model = build_model(name, in_channels=channels, num_classes=7, image_size=(size, size))
    out = model(torch.randn(BATCH, channels, size, size))
    assert out.shape == (BATCH, 7)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builtins_expose_features_and_classifier(built: dict[str, nn.Module], name: str) -> None:
    model = built[name]
    assert isinstance(model.classifier[0], nn.Flatten)
    x = torch.randn(BATCH, 1, 32, 32)
    assert torch.equal(model.classifier(model.features(x)), model(x))


def test_vgg_fc_parameters_sit_in_the_classifier(built: dict[str, nn.Module]) -> None:
    model = built["vgg_fc"]
    total = _params(model)
    assert 3_000_000 < total < 4_000_000
    assert _params(model.classifier) > 0.9 * total


def test_resnet18_parameter_count() -> None:
    total = _params(build_model("resnet18", in_channels=3))
    assert 11_000_000 < total < 11_300_000


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_depends_only_on_seed(name: str) -> None:
    torch.manual_seed(123)
    first = build_model(name, in_channels=3)
    after_first = torch.rand(4)

    torch.rand(1000)  # disturb the RNG; re-seeding must make that irrelevant
    build_model("lenet")
    torch.manual_seed(123)
    second = build_model(name, in_channels=3)
    after_second = torch.rand(4)

    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The same amount of randomness was drawn both times.
    assert torch.equal(after_first, after_second)


def test_resnet18_build_leaves_batch_norm_statistics_fresh(built: dict[str, nn.Module]) -> None:
    for m in built["resnet18"].modules():
        if isinstance(m, nn.BatchNorm2d):
            assert int(m.num_batches_tracked) == 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_split_point_of_builtins_is_exact(built: dict[str, nn.Module], name: str) -> None:
    model = built[name]
    features, head = split_point(model)
    assert features is model.features and head is model.classifier
    x = torch.randn(BATCH, 1, 32, 32)
    assert torch.equal(head(features(x)), model(x))


def test_split_at_on_builtin_names_a_child(built: dict[str, nn.Module]) -> None:
    model = built["lenet"]
    features, head = split_point(model, split_at="classifier")
    x = torch.randn(BATCH, 1, 32, 32)
    assert torch.equal(head(features(x)), model(x))


def test_split_point_of_sequential_starts_head_at_flatten() -> None:
    torch.manual_seed(0)
    model = _small_cnn()
    features, head = split_point(model)
    assert isinstance(features[-1], nn.MaxPool2d)
    assert isinstance(head[0], nn.Flatten)
    x = torch.randn(BATCH, 1, 8, 8)
    assert torch.equal(head(features(x)), model(x))
    # The parts share parameters with the model rather than copying them.
    assert {id(p) for p in features.parameters()} | {id(p) for p in head.parameters()} == {
        id(p) for p in model.parameters()
    }


def test_split_at_on_sequential() -> None:
    torch.manual_seed(0)
    model = _small_cnn()
    features, head = split_point(model, split_at="5")  # the first Linear
    assert isinstance(features[-1], nn.Flatten)
    assert isinstance(head[0], nn.Linear)
    x = torch.randn(BATCH, 1, 8, 8)
    assert torch.equal(head(features(x)), model(x))


def test_split_at_unknown_name() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2))
    with pytest.raises(UsageError) as info:
        split_point(model, split_at="x")
    assert str(info.value) == (
        "--split-at 'x' names no module of the model; its children are: 0, 1, 2"
    )


def test_split_at_first_child_leaves_no_features() -> None:
    with pytest.raises(UsageError, match="no feature part"):
        split_point(_small_cnn(), split_at="0")


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 2, 3)),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2), nn.Conv1d(1, 1, 1)),
        nn.Linear(4, 2),
    ],
    ids=["mlp-only", "conv-only", "conv-after-linear", "not-sequential"],
)
def test_no_boundary(model: nn.Module) -> None:
    with pytest.raises(UsageError) as info:
        split_point(model)
    assert str(info.value) == (
        "model has no conv/FC boundary: expose `features` and `classifier`, "
        "use an nn.Sequential, or pass --split-at MODULE"
    )


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(UsageError) as info:
        build_model("foo")
    assert str(info.value) == (
        "unknown model 'foo'; choose one of: lenet, vgg_fc, resnet18, or path/to/file.py:factory or package.module:factory"
    )


@pytest.fixture
def factories(tmp_path, monkeypatch) -> str:
    """A throwaway importable module of user factories; returns its name."""
    (tmp_path / "user_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def no_args():
                return nn.Linear(3, 2)

            def classes_only(num_classes):
                return nn.Linear(3, num_classes)

            def not_a_module():
                return "surprise"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_models"


def test_factory_without_arguments(factories: str) -> None:
    model = build_model(f"{factories}:no_args", num_classes=5)
    assert model.out_features == 2


def test_factory_receives_only_what_it_declares(factories: str) -> None:
    model = build_model(f"{factories}:classes_only", in_channels=3, num_classes=5)
    assert model.out_features == 5


def test_factory_returning_non_module(factories: str) -> None:
    with pytest.raises(UsageError, match="returned str, not a torch.nn.Module"):
        build_model(f"{factories}:not_a_module")


def test_factory_missing_attribute(factories: str) -> None:
    with pytest.raises(UsageError, match="has no attribute 'nope'"):
        build_model(f"{factories}:nope")


def test_factory_module_not_importable() -> None:
    expected = "cannot import module 'no_such_pkg_xyz.mod'.*No module named"
    with pytest.raises(UsageError, match=expected):
        build_model("no_such_pkg_xyz.mod:factory")


def test_image_too_small_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="too small"):
        build_model("vgg_fc", image_size=(4, 4))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vgg_fc_reaches_95_percent_on_digits_in_300_steps_with_finite_losses(tmp_path):
    """``convoy train --model vgg_fc --steps 300`` at its defaults (its own learning rate, two
    workers): 96.7% here; an untrained model scores about 10%. One to two minutes on 2 cores."""
    run = tmp_path / "run"
    done = convoy_in_process("train", "--model", "vgg_fc", "--steps", "300", "--no-progress", "--out", str(run))
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "summary.json").read_text())["test_accuracy"] >= 0.95
    records = [json.loads(line) for path in run.glob("metrics-rank*.jsonl") for line in path.read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    assert len(losses) == 2 * 300 and all(math.isfinite(loss) for loss in losses)
