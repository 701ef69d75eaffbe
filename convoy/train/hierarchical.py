"""``--sync hierarchical`` from a TrainConfig: profile the nodes, plan the clusters, build the strategy."""
from __future__ import annotations

from convoy import runtime
from convoy.cluster import load_profile_file, parse_clusters, parse_weights, plan_job
from convoy.compress import Compressor, Memory
from convoy.sync.hierarchical import Hierarchical
from convoy.train.config import TrainConfig


def build_hierarchical(config: TrainConfig, ctx: runtime.Context, compressor: Compressor, memory: Memory,
                       total_steps: int) -> Hierarchical:
    """Profile every rank, cluster on rank 0, and return this rank's strategy; a collective.

    The job's last step is an exchange too, so the saved model is the clusters' combination.
    """
    overrides = load_profile_file(config.node_profile) if config.node_profile else None
    plan = plan_job(parse_weights(config.indicator_weights), parse_clusters(config.clusters), config.seed,
                    config.reelect_every, config.server_choice, overrides, ctx.local_rank)
    return Hierarchical(plan, config.exchange_every, compressor, memory, config.warmup(),
                        last_step=total_steps - 1)
