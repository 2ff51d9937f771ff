"""The chief's side of pipeline replicas (model parallelism): submitting a replica's stage tasks,
and watching them.

A pipeline replica is one task per stage position (``plan.stages``), each pinned to its worker
task (``ReplicaPlan.stage_tasks``). The chief first has every later stage's worker open the
listener its upstream neighbour connects to (``open_stage_listener``), then submits the stages;
the first stage's future stands for the replica (``Session.replica_futures``: it ends when the
pipeline stops and fails when any stage fails, since a failed or lost stage closes its links),
the others are kept in ``Session.stage_futures`` so they are watched, cancelled and restarted
with it.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from distributed import Future

from dtrain.worker.stage_tasks import open_stage_listener, stage_task
from dtrain.worker.stages import link_shape

if TYPE_CHECKING:  # pragma: no cover
    from dtrain.chief.session import Session


def submit(session: Session, replica: Any, refs: list[tuple[str, str]], start: int, attempt: int) -> Future:
    """Submit every stage of ``replica``; returns the first stage's future."""
    s, plan = session, session.plan
    secret = s.__dict__.setdefault("stage_secret", secrets.token_bytes(32))  # one per run, like the ps data plane's
    tls = bool(s.shards.tls)
    base = f"{s.token}-g{s.generation}-{attempt}-r{replica.index}"
    keys = {p: f"dtrain-stage-{base}-p{p}" for p in range(1, plan.stage_positions)}
    opening = {p: s.client.submit(open_stage_listener, keys[p], secret, tls, link_shape(s.spec, plan, p - 1),
                                  workers=[s.conn.tasks[replica.stage_tasks[p]]], allow_other_workers=False,
                                  pure=False, key=f"{keys[p]}-listen")
               for p in keys}
    links = {"secret": secret, "tls": tls, "keys": keys,
             "endpoints": {p: tuple(f.result(timeout=s.spec.cluster.wait_s)) for p, f in opening.items()}}
    futures = []
    for p in range(plan.stage_positions):
        futures.append(s.client.submit(
            stage_task, s.spec, plan, replica.index, p, refs, start, s.shards.data_plane, links, attempt,
            workers=[s.conn.tasks[replica.stage_tasks[p]]], allow_other_workers=False, pure=False,
            key=f"dtrain-stage-{base}-p{p}"))
    s.stage_futures[replica.index] = futures[1:]
    return futures[0]


def failure(session: Session) -> str | None:
    """The first failed later stage, as the session reports a failed replica."""
    for index, futures in session.stage_futures.items():
        task = session.plan.replicas[index].stage_tasks
        for p, fut in enumerate(futures, start=1):
            if fut.status == "error":
                exc = fut.exception(timeout=5)
                return f"replica {index} stage {p} on {task[p]} failed: {type(exc).__name__}: {exc}"
            if fut.status == "cancelled":
                return f"replica {index} stage {p} on {task[p]} was cancelled (its worker was lost?)"
    return None


def futures_of(session: Session, replicas: list[int] | None = None) -> list[Future]:
    """The later stages' futures (of ``replicas``, default all)."""
    return [f for i, fs in session.stage_futures.items() if replicas is None or i in replicas for f in fs]


def collect(session: Session, stats: list[dict[str, Any]]) -> None:
    """Add each replica's later stages' counters to its stats (``extra["stages"]``)."""
    for index, futures in session.stage_futures.items():
        if index < len(stats):
            stats[index].setdefault("extra", {})["stages"] = [f.result(timeout=30) for f in futures]
