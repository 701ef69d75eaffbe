"""Torch's own hierarchical SGD, the peer of ``convoy train --sync hierarchical``.

DDP with torch's post-local-SGD comm hook (gradients all-reduced every step
only within a subgroup of ``--group-size`` consecutive ranks, e.g. one rack)
and ``HierarchicalModelAverager`` (parameters averaged over all ranks every
``--period`` steps), both from ``torch.distributed.algorithms``. Same data
order, model, optimizer and metrics files as ``bench/peers/ddp_train.py``.
Run one process per rank, e.g.::

    convoy bench cluster --hosts 4 --rate 1gbit --racks 2 --inter-rack-rate 50mbit -- \\
        bench/peers/hier_sgd.py --model vgg_fc --steps 100 --period 4 --group-size 2 --out runs/hier-sgd
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.peers.ddp_train import arguments, run_peer  # noqa: E402


def local_sgd(period: int, group_size: int, adam: bool = False):
    """``setup`` for ``train_ddp``: subgroup gradient all-reduce + a world-wide average every ``period`` steps.

    With ``adam``, torch.optim.Adam with the SGD optimizer's learning rate and
    weight decay replaces it (convoy's ``--optimizer adam``).
    """

    def setup(net: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if adam:
            group = optimizer.param_groups[0]
            optimizer = torch.optim.Adam(net.parameters(), lr=group["lr"], weight_decay=group["weight_decay"])
        subgroup, _ = dist.new_subgroups(group_size=group_size)
        net.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=0),
                               post_localSGD_hook)
        averager = HierarchicalModelAverager(OrderedDict([(period, dist.get_world_size())]), warmup_steps=0)
        return PostLocalSGDOptimizer(optim=optimizer, averager=averager)

    return setup


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--period", type=int, default=4, help="steps between world-wide parameter averages")
    parser.add_argument("--group-size", type=int, default=2, help="consecutive ranks that all-reduce gradients "
                        "every step")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    args = parser.parse_args()
    setup = local_sgd(args.period, args.group_size, args.optimizer == "adam")
    del args.period, args.group_size, args.optimizer
    run_peer(args, setup=setup)


if __name__ == "__main__":
    main()
