"""Options that ``convoy simulate`` and ``convoy plan`` share: which model, profiled how."""
from __future__ import annotations

import argparse

from convoy.errors import UsageError
from convoy.sim.cpu import CpuCosts, measure_cpu_costs
from convoy.sim.profile import ModelProfile, load_profile, profile_model
from convoy.train.config import DataConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg_fc", help="model to profile on this machine: lenet, vgg_fc, "
                   "resnet18, or package.module:factory (default: vgg_fc)")
    p.add_argument("--profile", metavar="FILE", help="per-layer sizes and times from a JSON file instead "
                   "of profiling (keys: name, batch_size, layers: [{name, shapes, forward_s, backward_s, "
                   "update_s, head}]); see --save-profile")
    p.add_argument("--batch-size", type=int, default=DataConfig.batch_size, help="samples per worker per step "
                   "(default: %(default)s, convoy train's)")
    p.add_argument("--input-shape", default="1,32,32", help="C,H,W of one input when profiling "
                   "(default: 1,32,32, the digits dataset)")
    p.add_argument("--save-profile", metavar="FILE", help="also write the profile used to FILE (JSON)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def resolve_profile(args: argparse.Namespace) -> tuple[ModelProfile, CpuCosts]:
    """The model's profile at ``--batch-size`` and this machine's CPU costs (defaults for a file)."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.profile:
        profile, costs = load_profile(args.profile).at_batch(args.batch_size), CpuCosts()
    else:
        try:
            c, h, w = (int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise UsageError(f"--input-shape must be C,H,W, got {args.input_shape!r}") from None
        profile = profile_model(args.model, args.batch_size, in_channels=c, image_size=(h, w))
        costs = measure_cpu_costs()
    if args.save_profile:
        import json
        from pathlib import Path

        Path(args.save_profile).write_text(json.dumps(profile.to_json(), indent=1))
    return profile, costs
