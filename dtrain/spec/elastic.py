"""Elastic replicas in the spec: ``cluster.jobs.worker: {min: M, max: N}`` (a plain number keeps a
fixed count).

The replicas' job then has N task slots, each with its own part of the data; a slot runs a
replica while a worker serves it. Workers that join the cluster take free slots at once, and
workers that leave take their replica with them, with no recovery; the run goes on while at least
M replicas live (the chief's side: ``dtrain.chief.elastic``). In sync mode the quorum follows the
live replicas: ``replicas_to_aggregate`` is a fraction of them (``all``, the default, or 0.75).
In-graph replication, backups (``total_num_replicas``), the staleness gate, pipeline stages and
sharded sources need a fixed set, so those combinations are refused with the fix.

``cluster.adaptive: {min, max}`` lets Dask's adaptive scaling size the embedded cluster's replica
workers between its bounds (``dtrain.deploy.adaptive``); on a cluster of the user's own, its own
``cluster.adapt()`` does that, and the replicas follow it.

Here: the rules over the whole spec and the answers the plan and the deployment ask of it (the
replicas' elastic bounds, the adaptive bounds), each taking a ``PipelineView`` (``view``). The
section models, ``ElasticJob`` and ``AdaptiveSpec``, are in ``elastic_jobs``, below the sections
that hold them.
"""

from __future__ import annotations

from .elastic_jobs import ElasticJob
from .view import PipelineView


def elastic_of(spec: PipelineView) -> ElasticJob | None:
    """The replicas' job's elastic bounds, or None for a fixed count."""
    tasks = spec.cluster.jobs.get(spec.placement.worker_job)
    return tasks if isinstance(tasks, ElasticJob) else None


def adaptive_bounds(spec: PipelineView) -> tuple[int, int] | None:
    """(min, max) replica workers of an adaptive embedded cluster, or None without ``cluster.adaptive``."""
    adaptive, elastic = spec.cluster.adaptive, elastic_of(spec)
    if adaptive is None or elastic is None:
        return None
    return (adaptive.min or elastic.min, adaptive.max or elastic.max)


def _check_adaptive(spec: PipelineView, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
    loc = ("cluster", "adaptive")
    elastic = elastic_of(spec)
    if elastic is None or spec.is_graph:
        problems.append((loc, "adaptive scaling sizes the replicas' workers, so the replicas' job must be elastic: "
                         f"write cluster.jobs.{spec.placement.worker_job}: {{min: M, max: N}}"))
        return
    if spec.cluster.scheduler is not None:
        problems.append((loc, "scales the embedded cluster, and cluster.scheduler names a cluster of your own: "
                         "remove cluster.adaptive and call that cluster's adapt() (the replicas follow it)"))
    problem = bounds_problem(spec, *adaptive_bounds(spec))  # type: ignore[misc]
    if problem:
        problems.append((loc, problem))


def bounds_problem(spec: PipelineView, lo: int, hi: int) -> str | None:
    """Why ``lo`` to ``hi`` replica workers do not fit the elastic replicas' job, or None."""
    elastic = elastic_of(spec)
    assert elastic is not None
    if elastic.min <= lo <= hi <= elastic.max:
        return None
    return (f"min {lo} and max {hi} must lie within cluster.jobs.{spec.placement.worker_job} "
            f"({{min: {elastic.min}, max: {elastic.max}}}) with min <= max")


def check_elastic(spec: PipelineView, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
    """The combinations elastic replicas do not support, one problem each (the fix named)."""
    for job, tasks in spec.cluster.jobs.items():
        if isinstance(tasks, ElasticJob) and (spec.is_graph or job != spec.placement.worker_job):
            problems.append((("cluster", "jobs", job), f"only the replicas' job ({spec.placement.worker_job!r}) can "
                             "be elastic ({min, max}): ps tasks hold the variables and stay fixed; give a number"))
    if spec.cluster.adaptive is not None:
        _check_adaptive(spec, problems)
    elastic = elastic_of(spec)
    if elastic is None or spec.is_graph:
        return
    loc = ("cluster", "jobs", spec.placement.worker_job)
    t = spec.training
    if t.mode == "sync" and isinstance(t.replicas_to_aggregate, int):
        problems.append((("training", "replicas_to_aggregate"), "with elastic replicas the quorum follows the live "
                         f"replicas: give a fraction of them (e.g. 0.75) or all, not a count ({t.replicas_to_aggregate})"))
    if t.replication != "between_graph":
        problems.append((loc, "elastic replicas need replication: between_graph (in-graph steps use every task)"))
    if t.total_num_replicas is not None:
        problems.append((("training", "total_num_replicas"), "with elastic replicas the live workers decide the "
                         "count (between min and max); remove total_num_replicas"))
    if t.max_staleness is not None:
        problems.append((("training", "max_staleness"), "the staleness gate waits for every replica; it does not "
                         "apply to elastic replicas: remove it, or give the job a number of tasks"))
