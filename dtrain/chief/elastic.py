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
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from dtrain.plan.assign import assign_workers, is_replica_task
from dtrain.plan.compiler import Plan
from dtrain.spec.elastic import ElasticJob, elastic_of
from dtrain.spec.errors import RunError
from dtrain.spec.pipeline import PipelineSpec

if TYPE_CHECKING:
    from dtrain.chief.session import Session

logger = logging.getLogger(__name__)

RUNNING = ("running", "paused")  # the scheduler's worker states a replica can run in
FENCED = 0  # an attempt no submission has (the session counts them from 1)


class Elastic:
    """Joins and leaves of one session's replica slots (the module docstring)."""

    def __init__(self, session: Session, bounds: ElasticJob):
        self.session = session
        self.min, self.max = bounds.min, bounds.max
        self.joined = 0
        self.left = 0
        self.most = 0  # the most replicas live at once
        self.events: list[dict[str, Any]] = []
        self._below_since: float | None = None
        if session.conn.adaptive is not None:  # cluster.adaptive or dtrain.adapt: Dask sizes the cluster by it
            session.conn.adaptive.demand = self.demand

    def demand(self) -> int:
        """Replica slots that still have work: all but those whose replica finished (read by
        ``dtrain.deploy.adaptive`` on the cluster's event loop)."""
        futures = list(self.session.replica_futures)
        return self.max - sum(1 for f in futures if f is not None and f.status == "finished")

    def live(self) -> list[int]:
        """The replica slots a worker serves now."""
        s = self.session
        return [r.index for r in s.plan.replicas if r.task in s.conn.tasks]

    def poll(self) -> bool:
        """Free the slots of workers that left, fill free slots with workers that joined; say
        whether anything changed. A lost ps task is left to the recovery."""
        s = self.session
        workers = s.conn.workers()
        if any(s.conn.tasks.get(sh.task) not in workers for sh in s.plan.shards):
            return False
        # A worker being retired (a cluster scaled down: Dask's retire_workers, then close) waits for
        # its running task: its replica is told to end now, as one whose worker is gone already.
        running = {a: w for a, w in workers.items() if w.get("status", "running") in RUNNING}
        changed = False
        for r in s.plan.replicas:
            addr = s.conn.tasks.get(r.task)
            if addr is not None and addr not in running:
                self._leave(r.index, r.task, addr)
                changed = True
        assignment = assign_workers(s.spec, running, keep=s.conn.tasks)
        joining = [r for r in s.plan.replicas
                   if r.task not in s.conn.tasks and assignment.addresses.get(r.task) is not None
                   and assignment.addresses[r.task] not in s.conn.tasks.values()]
        for r in joining:
            s.conn.tasks[r.task] = assignment.addresses[r.task]  # type: ignore[assignment]
        if joining or changed:
            s.plan = s.shards.plan = s.compile_plan()
            s.write_cluster_info(refresh=False)
        if joining and s.spec.training.mode == "sync":
            s.shards.retire([r.index for r in joining], how="rejoin")
        for r in joining:
            s.submit_replicas(only=r.index)
            self.joined += 1
            self._event("join", r.index, r.task, s.conn.tasks[r.task])
        live = len(self.live())
        self.most = max(self.most, live)
        if joining:
            logger.warning("replica(s) %s joined (elastic); %d live", ", ".join(str(r.index) for r in joining), live)
        self._check_quorum(live)
        return changed or bool(joining)

    def retire_free(self) -> None:
        """Sync: the shards (new, or restored) wait for no free slot's replica."""
        s = self.session
        free = [r.index for r in s.plan.replicas if r.task not in s.conn.tasks]
        if free and s.spec.training.mode == "sync":
            s.shards.retire(free)

    def _leave(self, index: int, task: str, address: str) -> None:
        s = self.session
        fut = s.replica_futures[index]
        if fut is not None and fut.status == "finished":  # its work done (an idle worker retired): keep its stats
            del s.conn.tasks[task]
            self._event("release", index, task, address)
            return
        s.replica_futures[index] = None
        if fut is not None:
            try:
                s.client.cancel([fut], force=True)
            except Exception as exc:  # its worker is gone anyway
                logger.debug("cancel of replica %d failed: %s", index, exc)
        del s.conn.tasks[task]
        if s.shards.data_plane:  # fence it off: its next push is refused and its task ends, freeing the worker
            s.shards.set_owners({index: FENCED})
        if s.spec.training.mode == "sync":  # no step waits for it: the quorum follows the live replicas
            s.shards.retire([index])
        self.left += 1
        self._event("leave", index, task, address)
        logger.warning("replica %d left with its worker %s (elastic: no recovery); %d live", index, address,
                       len(self.live()))

    def _event(self, kind: str, index: int, task: str, address: str) -> None:
        self.events.append({"event": kind, "replica": index, "task": task, "address": address,
                            "step": self.session.global_step, "time": time.time()})

    def _check_quorum(self, live: int) -> None:
        if live >= self.min:
            self._below_since = None
            return
        now = time.monotonic()
        if self._below_since is None:
            self._below_since = now
            logger.warning("%d live replica(s), fewer than cluster.jobs.%s.min (%d): waiting up to %g s "
                           "(cluster.wait_s) for workers to join", live, self.session.spec.placement.worker_job,
                           self.min, self.session.spec.cluster.wait_s)
        elif now - self._below_since > self.session.spec.cluster.wait_s:
            raise RunError(f"{live} live replica(s) for {self.session.spec.cluster.wait_s:g} s (cluster.wait_s), "
                           f"fewer than cluster.jobs.{self.session.spec.placement.worker_job}.min ({self.min}); "
                           "add workers to the cluster")


def elastic(session: Session) -> Elastic | None:
    """The session's elastic replicas, or None for a fixed count."""
    bounds = elastic_of(session.spec)
    return None if bounds is None else Elastic(session, bounds)


def summary(session: Session) -> dict[str, Any]:
    """``replicas_joined``, ``replicas_left``, ``replicas_max`` (the most live at once) and, for an
    elastic run, ``elastic_log`` (every join and leave, with the global step)."""
    e = session.elastic
    if e is None:
        return {"replicas_joined": 0, "replicas_left": 0, "replicas_max": session.plan.num_replicas}
    return {"replicas_joined": e.joined, "replicas_left": e.left, "replicas_max": e.most,
            "replicas_min": e.min, "elastic_log": e.events}


def required_missing(spec: PipelineSpec, plan: Plan) -> list[str]:
    """The plan's missing tasks a run cannot start without: an elastic job's free replica slots
    are not among them (``dtrain.deploy.cluster.wait_for_tasks`` waits for ``min`` of them)."""
    if elastic_of(spec) is None:
        return list(plan.missing_tasks)
    return [t for t in plan.missing_tasks if not is_replica_task(spec, t)]


def live_count(session: Session) -> int:
    return session.plan.num_replicas if session.elastic is None else len(session.elastic.live())
