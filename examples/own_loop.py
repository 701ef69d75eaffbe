"""Your own training loop on convoy's engine.

Run on two local processes:   torchrun --standalone --nproc-per-node 2 examples/own_loop.py
or in one process:            python examples/own_loop.py
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import convoy
from convoy.data import GlobalBatchSampler, build_dataset, iterate_batches
from convoy.models import build_model

ctx = convoy.init()                              # gloo on CPU, NCCL on GPU; a world of one without torchrun
data = build_dataset("digits")
torch.manual_seed(0)                             # the same initial model on every rank
model = build_model("lenet", in_channels=data.in_channels, num_classes=data.num_classes).to(ctx.device)
group = dist.new_group() if ctx.world_size > 1 else None
sampler = GlobalBatchSampler(len(data.train), batch_size=32, world_size=ctx.world_size, rank=ctx.rank, seed=0)
epochs = 10
steps = epochs * len(sampler)
cosine = lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))  # noqa: E731  lr factor, 1 -> 0
engine = convoy.Engine(model, torch.optim.SGD, convoy.AllReduce(group), lr_lambda=cosine,
                       lr=0.05, momentum=0.9, weight_decay=5e-4)

for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x, y in iterate_batches(data.train, sampler):
        x, y = x.to(ctx.device), y.to(ctx.device)  # ctx.device: cpu, or cuda:<local rank> under NCCL
        loss = F.cross_entropy(model(x), y)      # forward waits only for each layer's own update
        engine.backward(loss)                    # sync + per-layer updates go on in the background
engine.synchronize()                             # every update applied: safe to evaluate or save

model.eval()
x, y = map(torch.stack, zip(*[(data.test[i][0], torch.as_tensor(data.test[i][1])) for i in range(len(data.test))]))
with torch.no_grad():
    accuracy = (model(x.to(ctx.device)).argmax(1).cpu() == y).float().mean().item()
print(f"rank {ctx.rank}: test accuracy {accuracy:.3f}")
engine.close()
convoy.shutdown()                                # wait for every rank, then leave the process group
