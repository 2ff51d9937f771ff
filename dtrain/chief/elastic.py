"""Elastic replicas, the chief's side: workers that join and leave a running async job.

With ``cluster.jobs.worker: {min: M, max: N}`` (``dtrain.spec.elastic``) the plan has N replica
slots, each with its own part of the data. The session polls the scheduler's workers (every
0.25 s, beside its liveness check) and:

- a slot whose worker left is freed, its replica's task cancelled: no recovery, no checkpoint
  restore; the ps keeps its step and the other replicas go on;
- a worker that joined takes a free slot at once (``dtrain.plan.assign``: by name where the
  workers are named, else automatically, the ps tasks kept where they are) and a replica starts
  there from the ps's current parameters, at the local step where that slot's replica stopped, so
  the slot's data goes on where it left off and no sample already consumed is read again;
- fewer than M live replicas for ``cluster.wait_s`` fails the run;
- in sync mode the shards retire a slot that is free or left (no step waits for it: the quorum
  is ``replicas_to_aggregate``'s share of the live replicas, and a gradient of the step before is
  dropped as stale as ever) and count it again when a worker joins.

A lost ps task is still a recovery from the latest checkpoint (``dtrain.chief.recovery``).

:class:`Elastic` decides (STYLE.md item 3): :meth:`Elastic.poll` returns a :class:`Reform` (the
slots to free, the workers that take free slots), and the session carries it out (cancels and
fences the leaving replicas, puts the run's plan on the workers there are now, submits the
joining ones), telling the elastic state of each leave and join (:meth:`Elastic.left`,
:meth:`Elastic.joined`) for its counts and log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dtrain.errors import RunError
from dtrain.plan.assign import assign_workers, is_replica_task
from dtrain.plan.compiler import Plan
from dtrain.spec.elastic import elastic_of
from dtrain.spec.elastic_jobs import ElasticJob
from dtrain.spec.pipeline import PipelineSpec

from .context import RunContext, RunState
from .replicas import ReplicaSet

logger = logging.getLogger(__name__)

RUNNING = ("running", "paused")  # the scheduler's worker states a replica can run in
FENCED = 0  # an attempt no submission has (the session counts them from 1)


@dataclass(frozen=True)
class Slot:
    """A replica slot and the worker task and address it leaves or joins with."""

    index: int
    task: str
    address: str


@dataclass(frozen=True)
class Reform:
    """Re-form the replica set: free the ``leaves``' slots, then fill the ``joins``' (in that order)."""

    leaves: list[Slot]
    joins: list[Slot]


class Elastic:
    """Joins and leaves of one run's replica slots (the module docstring). Reads the run's context
    and state and the replica set; changes nothing of them."""

    def __init__(self, ctx: RunContext, state: RunState, replicas: ReplicaSet, bounds: ElasticJob):
        self.ctx, self.state, self.replicas = ctx, state, replicas
        self.min, self.max = bounds.min, bounds.max
        self.joined = 0
        self.left = 0
        self.most = 0  # the most replicas live at once
        self.events: list[dict[str, Any]] = []
        self._below_since: float | None = None
        if ctx.conn.adaptive is not None:  # cluster.adaptive or dtrain.adapt: Dask sizes the cluster by it
            ctx.conn.adaptive.demand = self.demand

    def demand(self) -> int:
        """Replica slots that still have work: all but those whose replica finished (read by
        ``dtrain.deploy.adaptive`` on the cluster's event loop)."""
        futures = list(self.replicas.futures)
        return self.max - sum(1 for f in futures if f is not None and f.status == "finished")

    def live(self) -> list[int]:
        """The replica slots a worker serves now."""
        return self.replicas.live()

    def poll(self) -> Reform | None:
        """The slots of workers that left to free and the free slots workers that joined take, or
        None when nothing changed (a lost ps task is left to the recovery). Fewer than ``min`` live
        replicas for longer than ``cluster.wait_s`` fails the run (RunError)."""
        conn, plan = self.ctx.conn, self.state.plan
        workers = conn.workers()
        if any(conn.tasks.get(sh.task) not in workers for sh in plan.shards):
            return None
        # A worker being retired (a cluster scaled down: Dask's retire_workers, then close) waits for
        # its running task: its replica is told to end now, as one whose worker is gone already.
        running = {a: w for a, w in workers.items() if w.get("status", "running") in RUNNING}
        leaves = [Slot(r.index, r.task, addr) for r in plan.replicas
                  if (addr := conn.tasks.get(r.task)) is not None and addr not in running]
        keep = {t: a for t, a in conn.tasks.items() if t not in {s.task for s in leaves}}
        assignment = assign_workers(self.ctx.spec, running, keep=keep)
        joins = [Slot(r.index, r.task, addr) for r in plan.replicas
                 if r.task not in keep and (addr := assignment.addresses.get(r.task)) is not None
                 and addr not in keep.values()]
        live = len([r for r in plan.replicas if r.task in keep]) + len(joins)
        self.most = max(self.most, live)
        if joins:
            logger.warning("replica(s) %s joined (elastic); %d live", ", ".join(str(s.index) for s in joins), live)
        self._check_quorum(live)
        return Reform(leaves, joins) if leaves or joins else None

    def free(self) -> list[int]:
        """The slots no worker serves (sync: the shards, new or restored, wait for none of them)."""
        return [r.index for r in self.state.plan.replicas if r.task not in self.ctx.conn.tasks]

    def left_slot(self, slot: Slot, released: bool) -> None:
        """The session freed ``slot``; ``released``: its replica had finished (an idle worker
        retired), its stats kept."""
        if released:
            self._event("release", slot)
            return
        self.left += 1
        self._event("leave", slot)
        logger.warning("replica %d left with its worker %s (elastic: no recovery); %d live", slot.index,
                       slot.address, len(self.live()))

    def joined_slot(self, slot: Slot) -> None:
        """The session started a replica in ``slot``."""
        self.joined += 1
        self._event("join", slot)

    def _event(self, kind: str, slot: Slot) -> None:
        self.events.append({"event": kind, "replica": slot.index, "task": slot.task, "address": slot.address,
                            "step": self.state.global_step, "time": time.time()})

    def _check_quorum(self, live: int) -> None:
        spec = self.ctx.spec
        if live >= self.min:
            self._below_since = None
            return
        now = time.monotonic()
        if self._below_since is None:
            self._below_since = now
            logger.warning("%d live replica(s), fewer than cluster.jobs.%s.min (%d): waiting up to %g s "
                           "(cluster.wait_s) for workers to join", live, spec.placement.worker_job,
                           self.min, spec.cluster.wait_s)
        elif now - self._below_since > spec.cluster.wait_s:
            raise RunError(f"{live} live replica(s) for {spec.cluster.wait_s:g} s (cluster.wait_s), "
                           f"fewer than cluster.jobs.{spec.placement.worker_job}.min ({self.min}); "
                           "add workers to the cluster")


def elastic(ctx: RunContext, state: RunState, replicas: ReplicaSet) -> Elastic | None:
    """The run's elastic replicas, or None for a fixed count."""
    bounds = elastic_of(ctx.spec)
    return None if bounds is None else Elastic(ctx, state, replicas, bounds)


def summary(e: Elastic | None, plan: Plan) -> dict[str, Any]:
    """``replicas_joined``, ``replicas_left``, ``replicas_max`` (the most live at once) and, for an
    elastic run, ``elastic_log`` (every join and leave, with the global step)."""
    if e is None:
        return {"replicas_joined": 0, "replicas_left": 0, "replicas_max": plan.num_replicas}
    return {"replicas_joined": e.joined, "replicas_left": e.left, "replicas_max": e.most,
            "replicas_min": e.min, "elastic_log": e.events}


def required_missing(spec: PipelineSpec, plan: Plan) -> list[str]:
    """The plan's missing tasks a run cannot start without: an elastic job's free replica slots
    are not among them (``dtrain.deploy.cluster.wait_for_tasks`` waits for ``min`` of them)."""
    if elastic_of(spec) is None:
        return list(plan.missing_tasks)
    return [t for t in plan.missing_tasks if not is_replica_task(spec, t)]


def live_count(e: Elastic | None, plan: Plan) -> int:
    return plan.num_replicas if e is None else len(e.live())
