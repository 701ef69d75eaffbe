"""Resuming a hierarchical or a hybrid job on another number of workers: clusters planned again, roles re-dealt.

**Hierarchical** (``--sync hierarchical``, ``--parallel data``). Between two
inter-cluster exchanges each cluster trains its own model: the clusters'
parameters are equal right after an exchange (checkpoints fall there, but a
stop signal commits the step in flight), their momentum never is (it is not
exchanged), nor what each cluster's error feedback still owes. None of that
state belongs to a cluster of the new world: its clusters are planned again,
as at a fresh start (its contribution history starts empty). So every new rank
starts from one well-defined state, the one the old clusters' next exchange
would combine: ``x = sum_k w_k x_k`` with the weights ``w_k`` that exchange
would use (:meth:`ContributionHistory.weights` of the recorded history), for
the parameters and every optimizer tensor (``x_k``: cluster ``k``'s model
file), and for error-feedback residuals, momentum-correction velocities and
batch-norm buffers (``x_k``: the mean over cluster ``k``'s members, what the
cluster's update owes to it) — formed in float64 and rounded once
(:func:`~convoy.checkpoint.deal.combine_clusters`). Every new rank holds the
same residual, so every new cluster, however it is planned, owes exactly the
combined residual. A value all clusters hold alike (the parameters at an
exchange step) is kept bit for bit. PowerSGD's warm start comes from the
heaviest cluster; the RNG of new rank ``j`` is old rank ``j mod N``'s; the
cycle's anchors (the parameters at its start, equal on every rank) are kept.

The clusters are re-planned only once the new world has measured its nodes
(:func:`convoy.train.hierarchical.build_hierarchy`): :func:`plan_replan` checks
and computes the mapping before anything is written (a refusal leaves the
checkpoint as it was), :func:`replan_hierarchical` then writes it with the new
plan in every rank file, so that a restart keeps those clusters.

**Hybrid** (``--parallel hybrid``, ``--sync allreduce``). The replicas of a
group (the conv workers, the FC workers) hold the same layers and optimizer
state, so state maps by role (:func:`relayout_hybrid`): each group's model
file goes to its writers in the new layout, and each group's rank files are
re-dealt within the group as a data-parallel job's are
(:func:`~convoy.checkpoint.deal.deal_states`: the group's mean residual kept).

Example::

    >>> replan = plan_replan(Path("ckpt"), 4)                 # reads only
    >>> replan.weights                                         # [0.5, 0.5]
    >>> replan_hierarchical(Path("ckpt"), replan, 3, plan, [0, 1], job, "clusters-rank0.pt")
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convoy.checkpoint.deal import ADDITIVE, SHARED, combine_clusters, deal_states
from convoy.checkpoint.files import model_file, rank_file
from convoy.checkpoint.format import CommitRecord, Layout
from convoy.checkpoint.relayout import copy_model_file, old_files, write_model_file
from convoy.checkpoint.reshard import commit_plan, fresh_staging, write_rank_file
from convoy.checkpoint.written import JobState, read_job
from convoy.cluster.contribution import ContributionHistory
from convoy.cluster.plan import ClusterPlan, clusters_from_tensors
from convoy.errors import UsageError
from convoy.utils.atomic import save_atomically

PLAN_FILES = "clusters-rank*.pt"   # convoy.train.hierarchical.plan_file's names


@dataclass
class Replan:
    """A hierarchical checkpoint mapped onto new clusters: what every new rank starts from."""

    job: JobState
    clusters: list[list[int]]                 # the old clusters
    weights: list[float]                      # their next exchange's weights
    layout: Layout                            # the model files'
    slots: dict[str, dict[str, torch.Tensor]]  # the combined model and optimizer state
    record: CommitRecord                      # cluster 0's model record: step, generation, hyper-parameters
    common: dict[str, torch.Tensor]           # per-rank state every new rank holds alike


def plan_replan(directory: Path, old_world: int) -> Replan:
    """Read the hierarchical checkpoint of ``old_world`` workers in ``directory`` and combine its
    clusters' state (see the module's text). Reads only.

    Raises:
        UsageError: files missing, damaged or of two jobs, or state that cannot be combined.
    """
    first = read_job(directory, old_world, [])
    saved = {k[len("sync.plan."):]: v for k, v in first.states[0].items() if k.startswith("sync.plan.")}
    if not saved:
        raise UsageError(f"{rank_file(directory, 0)} holds no cluster plan: not a hierarchical job's checkpoint; "
                         "resume it with its own --sync")
    clusters, _ = clusters_from_tensors(saved)
    if sorted(r for c in clusters for r in c) != list(range(old_world)):
        raise UsageError(f"{directory}: its cluster plan covers ranks {sorted(r for c in clusters for r in c)}, "
                         f"not the {old_world} workers that wrote it; move the directory away, or pass --no-resume")
    writers = sorted(int(p.name[len("model-rank"):-len(".ckpt")]) for p in directory.glob("model-rank*.ckpt"))
    chosen = []
    for index, members in enumerate(clusters):
        mine = [w for w in writers if w in members]
        if not mine:
            raise UsageError(f"{directory} lacks the model file of cluster {index} (ranks {members}); nothing was "
                             "changed (resume on the checkpoint's number of workers, or pass --no-resume)")
        chosen.append(model_file(directory, mine[0]).name)
    job = read_job(directory, old_world, chosen)
    state = job.states
    for rank, other in enumerate(state[1:], 1):
        if list(other) != list(state[0]) or any(other[k].shape != state[0][k].shape for k in other):
            raise UsageError(f"rank files 0 and {rank} hold different state; they are not of one job")
        if any(not torch.equal(other[k], state[0][k]) for k in other if k.startswith(("sync.plan.", "sync.contrib"))):
            raise UsageError(f"rank files 0 and {rank} hold different cluster plans; they are not of one job")
    history = ContributionHistory([len(c) for c in clusters])
    if "sync.contribution.cycles" in state[0]:
        history.restore(state[0]["sync.contribution.agreement_sum"].tolist(),
                        int(state[0]["sync.contribution.cycles"]))
    weights = history.weights()
    parts = [job.models[name] for name in chosen]
    for name, part in zip(chosen[1:], parts[1:]):
        mismatch = parts[0].layout.first_mismatch(part.layout)
        if mismatch:
            raise UsageError(f"{directory / name} holds another model than {chosen[0]} ({mismatch}); "
                             "they are not of one job")
        if part.record.extra.get("optimizer_meta") != parts[0].record.extra.get("optimizer_meta"):
            raise UsageError(f"the clusters' optimizers in {chosen[0]} and {name} differ in more than their "
                             "tensors; they cannot be combined (resume on the checkpoint's number of workers)")
    return Replan(job, clusters, weights, parts[0].layout, _combined_model([p.slots() for p in parts], weights),
                  parts[0].record, _common_state(state, clusters, weights))


def _combined_model(models: list[dict[str, dict[str, torch.Tensor]]], weights: list[float]
                    ) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for slot, tensors in models[0].items():
        out[slot] = {}
        for key, value in tensors.items():
            values = [model[slot][key] for model in models]
            if value.is_floating_point():
                out[slot][key] = combine_clusters([[v] for v in values], weights)
            elif all(torch.equal(v, value) for v in values):
                out[slot][key] = value
            else:
                raise UsageError(f"the clusters' {slot}.{key} differ and cannot be combined; resume on the "
                                 "checkpoint's number of workers")
    return out


def _common_state(states: list[dict[str, torch.Tensor]], clusters: list[list[int]],
                  weights: list[float]) -> dict[str, torch.Tensor]:
    """The per-rank state every new rank holds alike (the plan, contribution history and RNG are
    each rank's own, set when the files are written)."""
    heaviest = clusters[max(range(len(clusters)), key=lambda k: (weights[k], -k))][0]
    out = {}
    for key, value in states[0].items():
        kind, _, rest = key.partition(".")
        sub = rest.split(".", 1)[0] if kind == "sync" else ""
        column = [state[key] for state in states]
        if kind == "rng" or sub in ("plan", "contribution"):
            continue
        if ((kind == "sync" and sub in ADDITIVE) or kind == "buffer") and value.is_floating_point():
            out[key] = combine_clusters([[column[r] for r in members] for members in clusters], weights)
        elif (kind == "sync" and sub == "anchor") or kind == "buffer" or kind == "scaler":
            if kind == "sync" and not all(torch.equal(t, value) for t in column):
                raise UsageError(f"the ranks' {rest} differ: the checkpoint is not of one hierarchical job")
            out[key] = value   # anchors are equal everywhere; integer buffers and the loss scale: rank 0's
        elif kind == "sync" and sub in SHARED:
            out[key] = column[heaviest]
        else:
            raise UsageError(f"the rank files hold {key!r}, per-rank state convoy cannot map onto new clusters; "
                             "resume on the checkpoint's own number of workers")
    return out


def replan_hierarchical(directory: Path, replan: Replan, world: int, plan: ClusterPlan, writers: list[int],
                        job: dict[str, Any], plan_name: str) -> None:
    """Write ``replan`` for ``world`` workers clustered as ``plan`` and put it in place (crash-safe,
    :func:`convoy.checkpoint.reshard.commit_plan`): the combined model file for each of
    ``writers``, a rank file per rank with the new plan and an empty contribution history, and
    the plan file ``plan_name``. ``job``: what the records say of the new job.

    The rank files hold the keys, in the order, that the new job's own checkpoints will (a rank
    file whose layout changes is created anew, and until that commit holds no step).
    """
    staging = fresh_staging(directory)
    put: list[str] = []
    for writer in writers:
        put += write_model_file(staging / model_file(directory, writer).name, replan.layout, replan.slots,
                                replan.record, {**replan.record.extra, **job})
    fresh = {f"sync.plan.{key}": value for key, value in plan.as_tensors().items()}
    fresh["sync.contribution.agreement_sum"] = torch.zeros(len(plan.clusters), dtype=torch.float64)
    fresh["sync.contribution.cycles"] = torch.zeros(1, dtype=torch.int64)
    anchors = {k: v for k, v in replan.common.items() if k.startswith("sync.anchor.")}
    if len(plan.clusters) == 1:
        anchors = {}   # one cluster exchanges nothing: no cycle to anchor
    elif not anchors:   # the old job had one cluster: the cycle starts from the combined model
        anchors = _anchors(replan)
    old = replan.job.states
    for rank in range(world):
        state: dict[str, torch.Tensor] = {}
        for key in old[0]:
            if key.startswith(("sync.plan.", "sync.contribution.")):
                state.update((k, v) for k, v in fresh.items() if k.startswith(key.rsplit(".", 1)[0] + "."))
            elif key.startswith("rng."):
                state[key] = old[rank % len(old)][key]
            elif not key.startswith("sync.anchor."):
                state[key] = replan.common[key]
            if key.startswith("sync.contribution.cycles"):
                state.update(anchors)   # the strategy's state ends with the anchors, by layer
        write_rank_file(staging / rank_file(directory, rank).name, state, rank, replan.job.record, job)
    save_atomically(plan.as_tensors(), staging / plan_name)
    commit_plan(directory, {"from": len(old), "to": world, "step": replan.job.step, "put": put + [plan_name],
                            "retire": old_files(directory, PLAN_FILES)})


def _anchors(replan: Replan) -> dict[str, torch.Tensor]:
    """Each layer's parameters, flat, by its place in the forward order: the cycle's anchors."""
    out = {}
    for index, name in enumerate(replan.record.extra["forward_order"]):
        slot = replan.slots[name]
        out[f"sync.anchor.{index}"] = torch.cat([t.reshape(-1) for k, t in slot.items() if k.startswith("param.")])
    return out


def relayout_hybrid(directory: Path, old: tuple[int, int], new: tuple[int, int], writers: tuple[list[int], list[int]],
                    job: dict[str, Any]) -> tuple[int, int, int]:
    """Map a hybrid checkpoint of ``old`` (conv workers, FC workers) onto ``new`` and put it in place:
    each group's model file copied to its ``writers`` (conv, FC) of the new layout, each group's
    rank files re-dealt within the group. ``job``: what the records say of the new job. Returns
    the step, the logged steps trained again and the residual values dealt only to float32 precision.

    Raises:
        UsageError: a missing or damaged file; nothing is changed then.
    """
    (conv, fc), (new_conv, new_fc) = old, new
    names = (model_file(directory, 0).name, model_file(directory, conv).name)
    state = read_job(directory, conv + fc, names)
    conv_states, conv_inexact = deal_states(state.states[:conv], new_conv)
    fc_states, fc_inexact = deal_states(state.states[conv:], new_fc)
    staging = fresh_staging(directory)
    put: list[str] = []
    for name, group in zip(names, writers):
        for writer in group:
            put += copy_model_file(state.models[name], staging / model_file(directory, writer).name)
    for rank, dealt in enumerate(conv_states + fc_states):
        write_rank_file(staging / rank_file(directory, rank).name, dealt, rank, state.record, job)
    commit_plan(directory, {"from": conv + fc, "to": new_conv + new_fc, "step": state.step, "put": put,
                            "retire": old_files(directory)})
    return state.step, state.retrained, conv_inexact + fc_inexact
