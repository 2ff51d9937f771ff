"""Validation of ``training.sync_tokens`` / ``init_tokens``: TensorFlow's SyncReplicasOptimizer token
queue (the ps side is dtrain/ps/tokens.py; the behaviour and its limits: docs/tokens.md).

What the token mode cannot do, one problem each with the fix named: it is sync, between-graph
replication with a fixed set of replicas whose variables live on one ps task. One task because
TensorFlow takes every accumulator's gradients and enqueues the tokens in one update op beside
the global step; dtrain's shards each count their own steps, so with several shards a token of
one shard's step would not say that the others reached it.

The rules read a ``PipelineView`` (``view``): ``PipelineSpec``'s validation (``pipeline``) runs
them, so this module knows the sections, never the pipeline.
"""

from __future__ import annotations

from .device import DeviceSpec
from .elastic import elastic_of
from .stages import stage_tasks
from .view import PipelineView

Problems = list[tuple[tuple[str | int, ...], str]]


def check_tokens(spec: PipelineView, problems: Problems) -> None:
    """Append the problems of the token keys (none when they are unset)."""
    t = spec.training
    if t.init_tokens is not None and not t.sync_tokens:
        problems.append((("training", "init_tokens"), "init_tokens applies to sync_tokens: true only; remove it "
                         "or set training.sync_tokens: true"))
    if not t.sync_tokens:
        return
    loc = ("training", "sync_tokens")
    if spec.is_graph:
        problems.append((loc, "sync_tokens applies to training pipelines (a model section); remove it"))
        return
    if t.mode != "sync":
        problems.append((loc, "sync_tokens is SyncReplicasOptimizer's token queue: it needs mode: sync; set "
                         "training.mode: sync or remove sync_tokens"))
    if t.replication != "between_graph":
        problems.append((loc, "sync_tokens needs replication: between_graph (in_graph steps aggregate every "
                         "replica in one graph, with no tokens)"))
    ps_job = spec.placement.ps_job
    ps_tasks = spec.cluster.num_tasks(ps_job) if ps_job in spec.cluster.jobs else 0
    if ps_tasks > 1:
        problems.append((loc, f"sync_tokens needs the variables on one ps task (job {ps_job!r} has {ps_tasks}): "
                         "the token queue and the update of every variable are one step of one task; set "
                         f"cluster.jobs.{ps_job}: 1"))
    for name, dev in spec.placement.variable_devices.items():
        d = DeviceSpec.from_string(dev)
        if (d.job or ps_job) != ps_job or (d.task or 0) != 0:
            problems.append((("placement", "variable_devices", name), f"{dev!r}: with sync_tokens every variable "
                             f"lives on /job:{ps_job}/task:0 (the token queue's task); remove the pin"))
    if elastic_of(spec) is not None:
        problems.append((loc, "sync_tokens needs a fixed number of replicas (total_num_replicas sizes the "
                         "tokens of a step): give the worker job a number of tasks"))
    elif stage_tasks(spec) > 1:
        problems.append((loc, "sync_tokens does not apply to pipeline stages (the later stages follow the "
                         "first one's steps): remove it"))
    if spec.has_sparse_tables():
        problems.append((loc, "sync_tokens does not support sparse embedding tables yet: set sparse: false on "
                         "the table, or remove sync_tokens"))
    workers = spec.cluster.num_tasks(spec.placement.worker_job) if spec.placement.worker_job in spec.cluster.jobs \
        else 0
    if t.init_tokens is not None and workers and isinstance(t.replicas_to_aggregate, int):
        total = spec.num_replicas()
        if t.init_tokens < t.replicas_to_aggregate - total:
            problems.append((("training", "init_tokens"), f"{t.init_tokens} tokens cannot start training: "
                             f"replicas_to_aggregate {t.replicas_to_aggregate} - {total} replicas = "
                             f"{t.replicas_to_aggregate - total} gradients must be pushed on init tokens before "
                             f"the first update; set init_tokens >= {t.replicas_to_aggregate - total} (as TF's "
                             "get_init_tokens_op)"))
