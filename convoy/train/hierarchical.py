"""``--sync hierarchical`` from a TrainConfig: profile the nodes, plan each engine group's clusters,
build the process groups, and hand each rank its strategy.

In data parallelism there is one engine group (every rank); in a hybrid job
two (the conv workers and the FC workers), each clustered on its own, with a
group of one rank as a single cluster. Resuming from ``--checkpoint-dir``,
each group keeps the clusters it was planned with (saved by
:meth:`Hierarchical.state_tensors`): the nodes are measured again, and a
measurement is noisy, so a fresh plan could split them differently. The plan
is also written beside the checkpoint files before the first step
(``clusters-rank<leader>.pt``), so a job stopped before any checkpoint was
committed starts again with the same clusters. On another number of workers the clusters are
planned again and the checkpoint's state mapped onto them (:mod:`convoy.train.elastic_layouts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from convoy import runtime
from convoy.checkpoint.files import rank_file
from convoy.checkpoint.recovery import rank_file_tensors
from convoy.checkpoint.written import recorded_job
from convoy.cluster import load_profile_file, parse_weights
from convoy.cluster.clustering import parse_clusters
from convoy.cluster.options import check_cluster_options
from convoy.cluster.plan import ClusterPlan, clusters_from_tensors, make_plan
from convoy.cluster.profile import NodeProfile, profile_job
from convoy.compress import Compressor, Memory
from convoy.errors import UsageError
from convoy.utils.atomic import save_atomically
from convoy.parallel.shape import JobShape
from convoy.parallel.groups import cluster_network
from convoy.sync.hierarchical import ClusterNetwork, Hierarchical
from convoy.train.checks import at_least
from convoy.train.config import TrainConfig
from convoy.train.elastic import job_record, node_of_ranks, writers_of
from convoy.train.elastic_layouts import plan_replan, replan_hierarchical


@dataclass
class Hierarchy:
    """Every engine group's plan and process groups, the same on every rank."""

    plans: list[ClusterPlan]
    networks: list[ClusterNetwork]

    def strategy(self, rank: int, config: TrainConfig, compressor: Compressor, memory: Memory,
                 total_steps: int) -> Hierarchical:
        """``rank``'s strategy, for the group it belongs to.

        The job's last step is an exchange too, so the saved model is the clusters' combination.
        """
        index = next(i for i, plan in enumerate(self.plans) if rank in plan.ranks())
        return Hierarchical(self.plans[index], config.sync.exchange_every, compressor, memory, config.compress.warmup(),
                            last_step=total_steps - 1, network=self.networks[index])


def build_hierarchy(config: TrainConfig, ctx: runtime.Context, shape: JobShape) -> Hierarchy:
    """Profile every rank, plan each engine group on its first rank, build every group's
    process groups; a collective on the default group (every rank, the same order).

    A checkpoint of another number of workers (which :func:`convoy.train.elastic.adapt_to_checkpoint`
    found mappable) is not resumed with its clusters: they are planned again, as at a fresh start,
    and its state mapped onto them (:mod:`convoy.train.elastic_layouts`).
    """
    overrides = load_profile_file(config.sync.node_profile) if config.sync.node_profile else None
    profiles = profile_job(overrides, ctx.local_rank)
    old_world = [_replanned(config, ctx.world_size) if ctx.rank == 0 else None]
    if dist.is_initialized() and ctx.world_size > 1:
        dist.broadcast_object_list(old_world, src=0)
    plans = [_agree_on_plan(config, ctx.rank, profiles, group, shape.clusters_in(group), old_world[0] is None)
             for group in shape.engine_groups]
    if old_world[0] is not None:
        _map_onto(config, ctx, plans[0], old_world[0])
    return Hierarchy(plans, [cluster_network(plan) for plan in plans])


def hierarchical_syncs(config: TrainConfig, ctx: runtime.Context, shape: JobShape,
                       total_steps: int) -> Callable[..., Hierarchical]:
    """Plan every engine group's clusters (a collective, :func:`build_hierarchy`), then make each
    engine's strategy: ``make(group, compressor, memory)``, ``group`` unused (the plan's own)."""
    hierarchy = build_hierarchy(config, ctx, shape)
    return lambda group, compressor, memory: hierarchy.strategy(ctx.rank, config, compressor, memory, total_steps)


def hierarchical_shape(config: TrainConfig) -> dict[str, Any]:
    """The clusters of every engine group (``auto``: chosen when the nodes are measured)."""
    return {"clusters": parse_clusters(config.sync.clusters)}


def check_hierarchical(config: TrainConfig, world: int) -> None:
    """``--sync hierarchical``'s checks of the whole job on ``world`` processes (UsageError, one line)."""
    sync = config.sync
    at_least("exchange_every", sync.exchange_every, 1)
    check_cluster_options(world, sync.clusters, sync.indicator_weights, sync.node_profile, sync.reelect_every,
                          sync.server_choice)


def _replanned(config: TrainConfig, world: int) -> int | None:
    """The number of workers that wrote the checkpoint this job resumes, when it is not ``world``."""
    if config.checkpoint.dir is None or config.checkpoint.resume is False or not Path(config.checkpoint.dir).is_dir():
        return None
    job = recorded_job(Path(config.checkpoint.dir))
    return job.world if job is not None and job.world != world else None


def _map_onto(config: TrainConfig, ctx: runtime.Context, plan: ClusterPlan, old_world: int) -> None:
    """Map the checkpoint of ``old_world`` workers onto ``plan``'s clusters (rank 0 writes, every rank
    waits); a collective. Each cluster's writers (its first rank on each node) get the model file."""
    nodes = node_of_ranks(ctx)
    outcome: list = [None]
    if ctx.rank == 0:
        directory = Path(config.checkpoint.dir)
        try:
            job = recorded_job(directory)
            writers = sorted(w for members in plan.clusters for w in writers_of(members, nodes))
            replan_hierarchical(directory, plan_replan(directory, old_world), ctx.world_size, plan, writers,
                                job_record(config, ctx.world_size, job.global_batch), plan_file(directory, 0).name)
        except UsageError as exc:
            outcome = [str(exc)]
    if dist.is_initialized() and ctx.world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise UsageError(outcome[0])


def _agree_on_plan(config: TrainConfig, rank: int, profiles: list[NodeProfile], group: list[int],
                   clusters: int | str, resume: bool = True) -> ClusterPlan:
    """``group``'s plan, made (or, with ``resume``, read from the checkpoint) on its first rank and
    broadcast. Without ``resume`` the plan is fresh, and kept by the mapping of the checkpoint."""
    leader = group[0]
    box: list = [None]
    if rank == leader:
        try:
            plan = make_plan([profiles[r] for r in group], parse_weights(config.sync.indicator_weights), clusters,
                             config.run.seed, config.sync.reelect_every, config.sync.server_choice).on_ranks(group)
            box[0] = _resumed_plan(config, plan, clusters) if resume else plan
            if resume and config.checkpoint.dir is not None and Path(config.checkpoint.dir).is_dir():
                save_atomically(box[0].as_tensors(), plan_file(Path(config.checkpoint.dir), leader))
        except UsageError as exc:   # sent on, so every rank fails alike instead of waiting
            box[0] = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=leader)
    if isinstance(box[0], str):
        raise UsageError(box[0])
    return box[0]


def _resumed_plan(config: TrainConfig, fresh: ClusterPlan, clusters: int | str) -> ClusterPlan:
    """The clusters this group's checkpoint was written with, when the job will resume from one."""
    if config.checkpoint.dir is None or config.checkpoint.resume is False:
        return fresh
    # The group's first rank plans, and its own file holds the plan; before its first commit, the plan file.
    directory, leader = Path(config.checkpoint.dir), min(fresh.ranks())
    saved = saved_sync_state(directory, leader)
    plan = {key[len("plan."):]: value for key, value in saved.items() if key.startswith("plan.")}
    if not plan and plan_file(directory, leader).exists():
        plan = torch.load(plan_file(directory, leader), weights_only=True)
    if not plan:
        return fresh
    members, capability = clusters_from_tensors(plan)
    if sorted(r for m in members for r in m) != sorted(fresh.ranks()):
        raise UsageError(f"{config.checkpoint.dir} was written by a job whose clusters held ranks "
                         f"{sorted(r for m in members for r in m)}, not {sorted(fresh.ranks())}; "
                         "resume with the same processes, or pass --no-resume")
    if clusters != "auto" and clusters != len(members):
        raise UsageError(f"{config.checkpoint.dir} was written with --clusters {len(members)}, this job asks "
                         f"for {clusters}; resume with --clusters {len(members)}, or pass --no-resume")
    return fresh.with_clusters(members, capability)


def plan_file(directory: Path, leader: int) -> Path:
    """Where the clusters of the engine group led by ``leader`` are kept from the job's start."""
    return directory / f"clusters-rank{leader}.pt"


def saved_sync_state(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    """The sync strategy's tensors (without the ``sync.`` prefix) in the newest valid area of
    ``rank``'s own checkpoint file; empty when there is none."""
    return rank_file_tensors(rank_file(directory, rank), "sync")
