"""convoy's compressors as DDP comm hooks, in real two-process gloo DDP jobs."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import convoy
from convoy.data import GlobalBatchSampler, build_dataset, iterate_batches
from convoy.errors import UsageError
from convoy.models import build_model
from tests.helpers import run_workers


def _train(rank: int, world: int, hook: tuple | None, steps: int) -> torch.Tensor:
    data = build_dataset("digits")
    torch.manual_seed(0)
    # Small buckets: several per step, regrouped by DDP after the first step.
    model = DistributedDataParallel(build_model("lenet"), bucket_cap_mb=0.05)
    if hook is not None:
        model.register_comm_hook(*convoy.ddp.comm_hook(hook[0], **hook[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = iterate_batches(data.train, GlobalBatchSampler(len(data.train), 16, world, rank))
    for _, (x, y) in zip(range(steps), batches):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # DDP's reducer, dropped while the interpreter shuts down, can abort the process
    # (gloo threads); dropping it here, while the process group lives, does not.
    del model, optimizer
    gc.collect()
    return params


def _compare_with_plain_ddp(rank: int, world: int, steps: int) -> dict:
    plain = _train(rank, world, None, steps)
    return {"full blocktopk": (_train(rank, world, ("blocktopk", {"block_fraction": 1.0}), steps) - plain).abs().max(),
            "1% blocktopk": _train(rank, world, ("blocktopk", {"block_fraction": 0.01}), steps),
            "plain": plain}


@pytest.mark.timeout(120)
def test_full_blocktopk_hook_equals_ddp_allreduce_and_sparse_hook_keeps_ranks_equal():
    results = run_workers(_compare_with_plain_ddp, 2, 6)
    for result in results:
        assert result["full blocktopk"] <= 1e-5
    sparse = [r["1% blocktopk"] for r in results]
    assert torch.equal(sparse[0], sparse[1])          # every rank applied the same averaged gradient
    assert torch.isfinite(sparse[0]).all() and not torch.equal(sparse[0], results[0]["plain"])


@pytest.mark.parametrize("name, options, words", [
    ("blocktop", {}, "choose one of: blocktopk, topk, fp16, powersgd"),
    ("topk", {"block_fraction": 0.1}, "takes no option block_fraction"),
    ("blocktopk", {"block_fraction": 2.0}, "fraction must be in (0, 1]"),
    ("powersgd", {"rank": 1, "start_iter": 1}, "start_powerSGD_iter"),
])
def test_bad_hook_names_and_options_are_usage_errors(name, options, words):
    with pytest.raises(UsageError, match=None) as error:
        convoy.ddp.comm_hook(name, **options)
    assert words in str(error.value)
