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
    memory.place = lambda key, like: arena.place("sync." + key, like, 0)
    placed = dict(state)
    for i in range(len(sizes)):   # the memory's own update, into the image
        compensated, sent = state[f"sync.residual.{i}"] + 1.0, torch.ones(sizes[i])
        memory.velocities[str(i)] = state[f"sync.velocity.{i}"]
        memory.update(compensated, str(i), sent)
        placed[f"sync.residual.{i}"] = memory.residuals[str(i)]
        assert torch.equal(placed[f"sync.residual.{i}"], compensated - sent)
    image = arena.image_of(placed, 0)
    assert image is not None
    from_image = _stored(directory / "image.ckpt", layout,
                         lambda store: store.write_image(1, 0, arena.fill(image, placed), 1))
    staged = _stored(directory / "staged.ckpt", layout,
                     lambda store: store.write_tensors(1, 0, [placed[s.key] for s in layout.slots[0].tensors], 1))
    assert from_image == staged


def _arena(like: torch.Tensor) -> RankArena:
    return RankArena(Layout("rank", [Slot("state", [TensorSpec.of("sync.residual.0", like)])]).slots[0])


def test_an_image_is_reused_only_when_its_residuals_are_dead_and_written():
    like = torch.zeros(1000)
    arena = _arena(like)
    memory = ResidualMemory()
    used = []
    for step in range(3):   # steps 0-2: each its own image; step 0's is being written
        memory.place = lambda key, like, step=step: arena.place("sync." + key, like, step)
        memory.update(like + step, "0", torch.zeros(1000))
        state = {"sync.residual.0": memory.residuals["0"]}
        used.append(arena.image_of(state, step))
        if step == 0:
            arena.begin_write(used[0])
        arena.step_ended(step)
    assert sorted(used) == list(range(IMAGES))
    # Step 3: step 1's image is dead (step 2 ended) and not being written; step 0's is still written.
    image_of_3 = arena.image_of({"sync.residual.0": arena.place("sync.residual.0", like, 3)}, 3)
    assert image_of_3 == used[1]
    arena.step_ended(3)
    # Step 4: step 2's image is dead; step 0's is still being written.
    assert arena.image_of({"sync.residual.0": arena.place("sync.residual.0", like, 4)}, 4) == used[2]
    arena.step_ended(4)
    # Step 5: step 3's image is dead, step 0's still being written: step 3's is taken.
    assert arena.image_of({"sync.residual.0": arena.place("sync.residual.0", like, 5)}, 5) == used[1]
    arena.step_ended(5)
    # Step 6: step 4's is dead; then step 0's write ends and it is free again.
    assert arena.place("sync.residual.0", like, 6) is not None
    arena.step_ended(6)
    arena.end_write(used[0])
    assert arena.image_of({"sync.residual.0": arena.place("sync.residual.0", like, 7)}, 7) == used[0]


def test_no_free_image_leaves_the_step_to_new_tensors_and_a_staged_write():
    like = torch.zeros(10)
    arena = _arena(like)
    for step in range(IMAGES):
        view = arena.place("sync.residual.0", like, step)
        arena.begin_write(arena.image_of({"sync.residual.0": view}, step))
        arena.step_ended(step)
    assert arena.place("sync.residual.0", like, IMAGES) is None
    assert arena.image_of({"sync.residual.0": torch.zeros(10)}, IMAGES) is None
    # A tensor the slot does not hold, or of another shape, is never placed.
    assert arena.place("sync.residual.9", like, IMAGES + 1) is None
    assert arena.place("sync.residual.0", torch.zeros(11), IMAGES + 1) is None
