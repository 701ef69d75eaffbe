"""Checkpoint format, corruption handling, export and import, in-process (real files)."""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from convoy.checkpoint import export_checkpoint, load_initial_state
from convoy.checkpoint.format import CommitRecord, FormatError, Layout, Slot, TensorSpec
from convoy.checkpoint.fsinfo import fs_info
from convoy.checkpoint.recovery import scan
from convoy.checkpoint.session import CheckpointSettings, start_checkpointing
from convoy.checkpoint.store import Store
from convoy.engine import Engine
from convoy.errors import UsageError
from convoy.models.lenet import lenet
from convoy.sync import AllReduce
from tests.checkpoint import checkpoint_job
from tests.checkpoint.checkpoint_job import assert_matches_trace, recovered

STEPS = 12


@pytest.fixture(scope="module")
def trace():
    return checkpoint_job.reference_trace(STEPS)


@pytest.fixture
def nine_steps(tmp_path):
    """A directory whose newest commit (step 9, generation 9) is in area B; area A holds step 8."""
    checkpoint_job.main(str(tmp_path), 9)
    return tmp_path


def _area_offset(path: Path, area: int) -> tuple[Store, int]:
    store = Store.open(path)
    offset = store.header + area * store.layout.area_size()
    store.close()
    return store, offset


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_commit_record_round_trip_and_any_flipped_byte_is_detected():
    record = CommitRecord(7, 12, 1, 4, [1, 2, 3], {"signature": "abc"})
    raw = record.pack()
    assert CommitRecord.unpack(raw + b"\0" * 100) == record
    for i in (0, 9, len(raw) // 2, len(raw) - 1):
        damaged = bytearray(raw)
        damaged[i] ^= 0x01
        with pytest.raises(FormatError):
            CommitRecord.unpack(bytes(damaged) + b"\0" * 100)


def test_layout_offsets_are_fixed_aligned_and_the_signature_names_the_first_difference():
    a = Layout("model", [Slot("conv", [TensorSpec("param.weight", "float32", [6, 1, 5, 5])]),
                         Slot("fc", [TensorSpec("param.weight", "float32", [10, 84])])])
    b = Layout("model", [Slot("conv", [TensorSpec("param.weight", "float32", [6, 1, 5, 5])]),
                         Slot("fc", [TensorSpec("param.weight", "float32", [10, 120])])])
    assert all(s.offset % 4096 == 0 for s in a.slots)
    assert a.signature() != b.signature()
    assert "layer 'fc' differs" in a.first_mismatch(b)
    assert a.first_mismatch(Layout.from_json(a.to_json())) is None


def test_dax_is_detected_from_the_mount_options(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/pmem0 {tmp_path} ext4 rw,relatime,dax=always 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    info = fs_info(tmp_path, str(mounts))
    assert info.dax and info.fs_type == "ext4" and info.mount_point == str(tmp_path)
    assert not fs_info("/", str(mounts)).dax
    assert "DAX persistent memory" in info.describe()


def _resume_and_finish(directory: Path, trace, capsys) -> str:
    """Resume from ``directory``, train to STEPS, check the result; return what was reported."""
    checkpoint_job.main(str(directory), STEPS)
    assert_matches_trace(recovered(directory), trace)
    assert recovered(directory)[0] == STEPS
    return capsys.readouterr().err


def test_a_flipped_byte_in_a_layer_of_the_newest_area_falls_back_to_the_other(nine_steps, trace, capsys):
    path = nine_steps / "model-rank0.ckpt"
    store, area_b = _area_offset(path, 1)
    _flip(path, area_b + store.layout.slots[2].offset + 100)
    reports = scan(Store.open(path))
    assert reports[0].valid and not reports[1].valid and "'classifier.1'" in reports[1].problem
    assert "checksum mismatch" in reports[1].problem
    err = _resume_and_finish(nine_steps, trace, capsys)
    assert "area B: damaged" in err and "using area A (step 8)" in err and "resumed" in err


def test_a_flipped_byte_in_the_newest_area_of_a_rank_file_falls_back_to_the_step_before(nine_steps, trace, capsys):
    """Rank files are checked by page sums, not CRC-32: a changed byte is still found."""
    path = nine_steps / "state-rank0.ckpt"
    store, area_b = _area_offset(path, 1)
    assert store.layout.checksum == "pagesum"
    _flip(path, area_b + store.layout.slots[0].offset + store.layout.slots[0].nbytes // 2)
    err = _resume_and_finish(nine_steps, trace, capsys)
    assert "state-rank0.ckpt: area B: damaged (layer 'state' checksum mismatch)" in err
    assert "resumed from" in err and "at step 8" in err


def test_a_damaged_commit_record_of_the_newest_area_falls_back_to_the_other(nine_steps, trace, capsys):
    path = nine_steps / "model-rank0.ckpt"
    _, area_b = _area_offset(path, 1)
    _flip(path, area_b + 30)
    err = _resume_and_finish(nine_steps, trace, capsys)
    assert "commit record is damaged" in err and "using area A (step 8)" in err


def test_a_truncated_file_falls_back_to_the_area_before_the_cut(nine_steps, trace, capsys):
    path = nine_steps / "model-rank0.ckpt"
    _, area_b = _area_offset(path, 1)
    with open(path, "r+b") as f:
        f.truncate(area_b + 70000)
    err = _resume_and_finish(nine_steps, trace, capsys)
    assert "truncated" in err and "using area A (step 8)" in err


def test_both_areas_damaged_is_a_clear_error_and_nothing_is_overwritten(nine_steps):
    path = nine_steps / "model-rank0.ckpt"
    for area in (0, 1):
        _, offset = _area_offset(path, area)
        _flip(path, offset + 30)
    before = path.read_bytes(), (nine_steps / "state-rank0.ckpt").read_bytes()
    with pytest.raises(UsageError, match="no usable checkpoint.*nothing was overwritten"):
        checkpoint_job.main(str(nine_steps), STEPS)
    assert (path.read_bytes(), (nine_steps / "state-rank0.ckpt").read_bytes()) == before


def test_another_models_checkpoint_is_refused_naming_the_first_mismatching_layer(nine_steps):
    model = lenet(num_classes=7)
    engine = Engine(model, torch.optim.SGD, AllReduce(), lr=0.1, momentum=0.9)
    with pytest.raises(UsageError, match="different model: layer 'classifier.5' differs"):
        start_checkpointing(CheckpointSettings(str(nine_steps)), model, engine, torch.optim.SGD,
                            {"lr": 0.1, "momentum": 0.9}, total_steps=5, steps_per_epoch=5)


def test_resume_equivalence_in_process(tmp_path, trace):
    for stop in (5, 9, STEPS):
        checkpoint_job.main(str(tmp_path), stop)
    assert_matches_trace(recovered(tmp_path), trace)


def test_export_is_a_plain_state_dict_that_init_from_and_load_state_dict_accept(nine_steps, trace, tmp_path):
    out = tmp_path / "exported.pt"
    exported = export_checkpoint(nine_steps, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == 9 and exported["step"] == 9
    model = lenet()
    model.load_state_dict(loaded["model"])
    for name, param in model.named_parameters():
        assert torch.equal(param, trace[9][f"param:{name}"])
    optimizer = torch.optim.SGD(list(model.features[0].parameters()), lr=0.1)
    optimizer.load_state_dict(loaded["optimizers"][loaded["layers"].index("features.0")])
    assert torch.equal(optimizer.state[model.features[0].weight]["momentum_buffer"],
                       trace[9]["momentum:features.0.0"])
    fresh = lenet()
    load_initial_state(fresh, out)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    torch.save(lenet(num_classes=3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UsageError, match="classifier.5.weight"):
        load_initial_state(lenet(), tmp_path / "other.pt")


def test_the_dax_path_writes_through_the_mapping_and_reads_back(tmp_path):
    layout = Layout("rank", [Slot("state", [TensorSpec("x", "float32", [1000])])])
    store = Store.create(tmp_path / "f.ckpt", layout)
    store.dax = True   # what a DAX mount gives: stores into the mapping plus msync
    data = torch.arange(1000, dtype=torch.float32)
    staged = torch.zeros(layout.slots[0].nbytes, dtype=torch.uint8)   # tensors are 64-byte aligned
    staged[:4000].view(torch.float32).copy_(data)
    raw = memoryview(staged.numpy())
    store.invalidate(1)
    store.write_slot(1, 0, raw, generation=1)
    store.commit(1, CommitRecord(1, 5, 0, 5, [zlib.crc32(raw)]))
    store.close()
    reopened = Store.open(tmp_path / "f.ckpt")
    assert reopened.verify(1).step == 5
    assert torch.equal(reopened.tensors(1, 0)["x"], data)
    reopened.close()


@pytest.mark.timeout(120)
def test_the_fp16_loss_scale_is_checkpointed_and_restored(tmp_path):
    """A resumed fp16 run scales its loss as the interrupted one would have (a fresh
    scale would skip different steps, and the runs would part)."""
    from convoy.engine.gradients import GradientGate, LossScaler

    def checkpointed_engine(scaler):
        torch.manual_seed(0)
        model = lenet()
        engine = Engine(model, torch.optim.SGD, AllReduce(None), gate=GradientGate(scaler=scaler), lr=0.01)
        session = start_checkpointing(CheckpointSettings(str(tmp_path)), model, engine, torch.optim.SGD,
                                      {"lr": 0.01}, total_steps=4, steps_per_epoch=4)
        return model, engine, session

    scaler = LossScaler(init_scale=1024.0)
    for overflowed in (True, False, False):
        scaler.update(overflowed, step=0)
    model, engine, session = checkpointed_engine(scaler)
    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    engine.backward(scaler.scale_loss(torch.nn.functional.cross_entropy(model(x), y)))
    engine.synchronize()
    session.listener.close()
    engine.close()

    resumed = LossScaler()
    _, engine2, session2 = checkpointed_engine(resumed)
    assert session2.start.step == 1
    assert {k: v.item() for k, v in resumed.state_tensors().items()} == {"scale": 512.0, "good_steps": 3,
                                                                       "skipped_steps": 1}
    session2.listener.close()
    engine2.close()


@pytest.mark.parametrize("memory", ["residual", "momentum correction"])
def test_the_rank_state_taken_after_a_step_keeps_its_values_through_the_next(memory):
    """Residuals are taken by reference (no copy on the training path) because both memories
    replace them every step; momentum correction's velocities, updated in place, are copied."""
    from convoy.checkpoint.snapshot import rank_state
    from convoy.compress import MomentumCorrection, ResidualMemory, build_compressor

    memory = ResidualMemory() if memory == "residual" else MomentumCorrection(0.9)
    compressor, _ = build_compressor("blocktopk", block_fraction=0.1, dense_below=0)
    sync = AllReduce(None, compressor, memory)
    shapes = (torch.Size([64, 32]),)
    generator = torch.Generator().manual_seed(4)
    sync.start_flat(0, shapes, torch.randn(64 * 32, generator=generator)).wait()
    state = rank_state(lenet(), sync)
    taken = {key: value.clone() for key, value in state.items() if key.startswith("sync.")}
    assert state["sync.residual.0"].data_ptr() == memory.residuals["0"].data_ptr()
    sync.start_flat(0, shapes, torch.randn(64 * 32, generator=generator)).wait()
    assert set(taken) == {f"sync.{key}" for key in memory.state_tensors()}
    for key, value in taken.items():
        assert torch.equal(state[key], value), f"{key} changed under the checkpoint"
        assert not torch.equal(value, memory.state_tensors()[key[len("sync."):]]), "the step changed nothing"
