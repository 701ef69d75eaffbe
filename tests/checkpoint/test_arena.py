"""Residuals placed in images of a rank file's slot: the same file as staged writes, and no image
reused while its residuals are live or being written."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from convoy.checkpoint.arena import IMAGES, RankArena
from convoy.checkpoint.format import CommitRecord, Layout, Slot, TensorSpec
from convoy.checkpoint.store import Store
from convoy.compress import MomentumCorrection, ResidualMemory


def _state(rng: torch.Generator, sizes: list[int]) -> dict[str, torch.Tensor]:
    state = {"buffer.bn.running_mean": torch.randn(7, generator=rng)}
    for i, size in enumerate(sizes):
        state[f"sync.residual.{i}"] = torch.randn(size, generator=rng)
        state[f"sync.velocity.{i}"] = torch.randn(size, generator=rng)
    state["rng.torch"] = torch.get_rng_state()
    return state


def _stored(path, layout: Layout, write) -> tuple[int, bytes]:
    store = Store.create(path, layout)
    store.invalidate(1)
    checksum = write(store)
    store.flush(1)
    store.commit(1, CommitRecord(1, 1, 0, 1, [checksum]))
    store.close()
    reopened = Store.open(path)
    try:
        assert reopened.verify(1).checksums == [checksum]
        return checksum, bytes(reopened.slot_bytes(1, 0))
    finally:
        reopened.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 40_000), min_size=1, max_size=3), st.integers(0, 99))
def test_a_slot_written_from_an_image_is_the_slot_written_from_the_tensors(tmp_path_factory, sizes, seed):
    directory = tmp_path_factory.mktemp("arena")
    rng = torch.Generator().manual_seed(seed)
    state = _state(rng, sizes)
    layout = Layout("rank", [Slot("state", [TensorSpec.of(k, v) for k, v in state.items()])], {"checksum": "pagesum"})
    arena = RankArena(layout.slots[0])
    memory = MomentumCorrection(0.9)
    memory.place_in(lambda key, like: arena.place("sync." + key, like, 0))
    placed = dict(state)
    for i in range(len(sizes)):   # the memory's own update, into the image
        compensated, sent = state[f"sync.residual.{i}"] + 1.0, torch.ones(sizes[i])
        memory.velocities[str(i)] = state[f"sync.velocity.{i}"]
        memory.update(compensated, str(i), sent)
        placed[f"sync.residual.{i}"] = memory.residuals[str(i)]
        assert torch.equal(placed[f"sync.residual.{i}"], compensated - sent)
    image = arena.hold(0)
    assert image is not None and arena.holds(image, placed)
    from_image = _stored(directory / "image.ckpt", layout,
                         lambda store: store.write_image(1, 0, arena.fill(image, placed), 1))
    staged = _stored(directory / "staged.ckpt", layout,
                     lambda store: store.write_tensors(1, 0, [placed[s.key] for s in layout.slots[0].tensors], 1))
    assert from_image == staged


def _arena(like: torch.Tensor) -> RankArena:
    return RankArena(Layout("rank", [Slot("state", [TensorSpec.of("sync.residual.0", like)])]).slots[0])


def _place(arena: RankArena, step: int, like: torch.Tensor) -> int | None:
    """Where the residual of ``step`` goes: its address, or None for a new tensor."""
    view = arena.place("sync.residual.0", like, step)
    return None if view is None else view.data_ptr()


def test_an_image_is_reused_only_when_its_residuals_are_dead_and_written():
    like = torch.zeros(1000)
    arena = _arena(like)
    memory = ResidualMemory()
    used = []
    for step in range(3):   # steps 0-2: each its own image; step 0's is checkpointed, being written
        memory.place_in(lambda key, like, step=step: arena.place("sync." + key, like, step))
        memory.update(like + step, "0", torch.zeros(1000))
        used.append(memory.residuals["0"].data_ptr())
        if step == 0:
            held = arena.hold(0)
            assert arena.holds(held, {"sync.residual.0": memory.residuals["0"]})
        arena.step_ended(step)
    assert len(set(used)) == IMAGES
    # Each later step takes the image of the step two before it (dead once the step after it
    # ended), never step 0's while it is being written.
    for step, expected in ((3, used[1]), (4, used[2]), (5, used[1]), (6, used[2])):
        assert _place(arena, step, like) == expected, step
        arena.step_ended(step)
    arena.end_write(held)
    assert _place(arena, 7, like) == used[0]


def test_a_step_only_partly_in_its_image_is_staged_and_its_image_kept_until_written():
    like = torch.zeros(10)
    layout = Layout("rank", [Slot("state", [TensorSpec.of("sync.residual.0", like),
                                            TensorSpec.of("sync.residual.1", like)])])
    arena = RankArena(layout.slots[0])
    state = {"sync.residual.0": arena.place("sync.residual.0", like, 0), "sync.residual.1": torch.ones(10)}
    held = arena.hold(0)
    assert held is not None and not arena.holds(held, state)
    for step in range(1, 4):   # the other two images serve the next steps; step 0's stays held
        assert arena.place("sync.residual.0", like, step).data_ptr() != state["sync.residual.0"].data_ptr()
        arena.step_ended(step)
    assert arena.place("sync.residual.0", like, 4) is not None
    arena.end_write(held)
    arena.step_ended(4)
    assert arena.place("sync.residual.0", like, 5).data_ptr() == state["sync.residual.0"].data_ptr()


def test_no_free_image_leaves_the_step_to_new_tensors():
    like = torch.zeros(10)
    arena = _arena(like)
    for step in range(IMAGES):
        assert arena.place("sync.residual.0", like, step) is not None
        assert arena.hold(step) is not None
        arena.step_ended(step)
    assert arena.place("sync.residual.0", like, IMAGES) is None
    assert arena.hold(IMAGES) is None
    # A tensor the slot does not hold, or of another shape, is never placed.
    assert arena.place("sync.residual.9", like, IMAGES + 1) is None
    assert arena.place("sync.residual.0", torch.zeros(11), IMAGES + 1) is None
