"""A plain torch DDP job whose gradients go through one of convoy's compressors.

Run on two local processes (gloo on CPU, NCCL with GPUs):
    torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py blocktopk block_fraction=0.01
    torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py powersgd rank=4
    torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py torch-powersgd rank=4   # torch's hook
    torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py none        # DDP's own all-reduce
The first argument is a name of convoy.ddp.hook_names() (or none); the others are the hook's
options as key=value; --epochs sets the length (22 steps an epoch on two processes).
A hook name or option that does not exist: one line naming the valid ones, exit status 2.
"""
import argparse
import ast
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import convoy
from convoy.data import GlobalBatchSampler, build_dataset, iterate_batches
from convoy.errors import UsageError, one_line
from convoy.models import build_model

def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)          # numbers and booleans
    except (ValueError, SyntaxError):
        return key, value                            # words such as block_metric=l2


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("hook", nargs="?", default="blocktopk",
                    help=f"{', '.join(convoy.ddp.hook_names())} or none (DDP's own all-reduce)")
parser.add_argument("options", nargs="*", help="the hook's options, key=value")
parser.add_argument("--epochs", type=int, default=40)
args = parser.parse_args()
hook_name, options = args.hook, dict(parse_option(arg) for arg in args.options)
try:
    # The pair can be made before the process group exists: bad input is refused before any rendezvous.
    hook = convoy.ddp.comm_hook(hook_name, **options) if hook_name != "none" else None
except UsageError as error:
    print(f"ddp_comm_hook.py: {one_line(str(error))}", file=sys.stderr)
    sys.exit(2)
ctx = convoy.init()                                  # process group from torchrun's environment
if ctx.world_size == 1:
    sys.exit("run it under torchrun: torchrun --standalone --nproc-per-node 2 examples/ddp_comm_hook.py")

data = build_dataset("digits")
torch.manual_seed(0)                                 # the same initial model on every rank
net = build_model("lenet", in_channels=data.in_channels, num_classes=data.num_classes).to(ctx.device)
model = DistributedDataParallel(net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
if hook is not None:
    model.register_comm_hook(*hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

sampler = GlobalBatchSampler(len(data.train), batch_size=32, world_size=ctx.world_size, rank=ctx.rank)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y in iterate_batches(data.train, sampler):
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()   # the hook runs here
        optimizer.step()

model.eval()
x, y = data.test.tensors
with torch.no_grad():
    accuracy = (model.module(x.to(ctx.device)).argmax(1).cpu() == y).float().mean().item()
print(f"rank {ctx.rank}: hook {hook_name} {options}: test accuracy {accuracy:.3f}")
del model, optimizer   # DDP's reducer dropped at interpreter exit can abort the process (gloo threads)
convoy.shutdown()
