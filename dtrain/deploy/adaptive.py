"""Dask's adaptive scaling of the embedded cluster's replica workers (``cluster.adaptive``).

Dask's own target (``Scheduler.adaptive_target``) sizes a cluster by the expected duration of its
queued and running tasks. A training job queues none: its replicas are long tasks that run from
the start to the end, and a ps actor runs no task at all. So Dask alone would never add a replica
worker. ``ReplicaAdaptive`` is Dask's ``Adaptive`` (its interval, its bounds, its damped scale-down
through ``retire_workers``, the candidates ``KeepRunTasks`` guards) with a target that also counts
the run's demand: the ps workers plus one worker per replica slot that still has work (``demand``,
which the chief sets; until it does, every slot). So the embedded cluster:

- starts with ``min`` replica workers, and the run starts as soon as they are up;
- grows to ``max``: each worker added is named for a free slot (``EmbeddedCluster``) and takes it
  at once (an elastic join, ``dtrain.chief.elastic``);
- starts a new worker for one that was lost, and retires the workers of replicas that finished.

The ps workers are never retired (``KeepRunTasks``), and never fewer than ``min`` replica workers
are kept. Dask's own target still counts: other work on the cluster can ask for more (up to max).

On a cluster of one's own that Python holds (a ``LocalCluster``, dask-jobqueue's clusters: any
``SpecCluster``), ``dtrain.adapt(cluster, spec)`` turns on the same scaling; the run on a client of
that cluster finds it (``find``) and gives it its demand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from distributed.deploy.adaptive import Adaptive

from dtrain.spec.elastic import adaptive_bounds, bounds_problem, elastic_of
from dtrain.spec.pipeline import PipelineSpec

logger = logging.getLogger(__name__)


class ReplicaAdaptive(Adaptive):
    """``Adaptive`` whose target is at least ``fixed`` (the ps workers) plus ``demand()``."""

    def __init__(self, *args: Any, fixed: int, slots: int, **kwargs: Any):
        self.fixed = fixed
        self.demand: Callable[[], int] = lambda: slots
        super().__init__(*args, **kwargs)

    async def target(self) -> int:
        try:
            wanted = self.fixed + int(self.demand())
        except Exception as exc:  # the session's state mid-change: keep Dask's own figure this round
            logger.debug("replica demand unavailable: %s", exc)
            wanted = 0
        return max(await super().target(), wanted)


def adapt(cluster: Any, spec: PipelineSpec, minimum: int | None = None, maximum: int | None = None,
          interval: float = 1.0) -> ReplicaAdaptive:
    """Dask's adaptive scaling of ``cluster`` (a ``SpecCluster`` of one's own: a ``LocalCluster``,
    dask-jobqueue's) for ``spec``'s elastic replicas: the ps workers plus between ``minimum`` and
    ``maximum`` replica workers (default: the replicas' job's ``{min, max}``), one per replica slot
    with work. Call it before ``dtrain.run(spec, client=...)`` on a client of ``cluster``."""
    bounds = elastic_of(spec)
    if bounds is None:
        raise ValueError(f"dtrain.adapt: the replicas' job must be elastic: give cluster.jobs."
                         f"{spec.placement.worker_job} as {{min: M, max: N}}")
    lo, hi = minimum or bounds.min, maximum or bounds.max
    problem = bounds_problem(spec, lo, hi)
    if problem:
        raise ValueError(f"dtrain.adapt: {problem}")
    fixed = sum(spec.cluster.num_tasks(j) for j in spec.cluster.jobs if j != spec.placement.worker_job)
    logger.info("adaptive scaling: %d to %d replica workers beside %d other(s), every %g s", lo, hi, fixed, interval)
    return cluster.adapt(Adaptive=ReplicaAdaptive, minimum=fixed + lo, maximum=fixed + hi,
                         interval=f"{interval}s", fixed=fixed, slots=hi)


def start(cluster: Any, spec: PipelineSpec) -> ReplicaAdaptive | None:
    """Turn on adaptive scaling of ``cluster`` (the embedded one) when the spec asks for it."""
    bounds = adaptive_bounds(spec)
    if bounds is None:
        return None
    return adapt(cluster, spec, *bounds, interval=spec.cluster.adaptive.interval_s)  # type: ignore[union-attr]


def find(client: Any) -> ReplicaAdaptive | None:
    """The ``ReplicaAdaptive`` of the cluster a client was made from (``dtrain.adapt``), if any."""
    found = getattr(getattr(client, "cluster", None), "_adaptive", None)
    return found if isinstance(found, ReplicaAdaptive) else None
