"""The run's replicas, the chief's side: submitting them, watching them, ending them.

:class:`ReplicaSet` owns one long-running Dask future per replica (pinned to its worker task's
address, never stolen), or, with in-graph replication, the step driver
(``dtrain.chief.ingraph``). Each submission is numbered (``attempt``): the shards accept a
replica index's pushes from its newest submission only (fencing; over the socket data plane and
over actor calls alike).

A pipeline replica (model parallelism) is one task per stage position (``plan.stages``), each
pinned to its worker task (``ReplicaPlan.stage_tasks``). The set first has every later stage's
worker open the listener its upstream neighbour connects to (``open_stage_listener``), then
submits the stages; the first stage's future stands for the replica (it ends when the pipeline
stops and fails when any stage fails, since a failed or lost stage closes its links), the others
are kept beside it so they are watched, cancelled and restarted with it.

The set reads the run's context and state (``chief/context.py``) and the shard group; it keeps
``RunState.retired`` (a resubmitted replica is no longer retired) and nothing else of them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from distributed import Future
from distributed import wait as wait_futures

from dtrain.plan.compiler import ReplicaPlan
from dtrain.plan.job import link_shape, replica_job, stage_job
from dtrain.worker.stage_tasks import open_stage_listener, stage_task
from dtrain.worker.tasks import replica_task

from . import data_report
from .calls import describe_failure
from .context import RunContext, RunState
from .drivers import new_driver
from .ingraph import InGraphDriver
from .ps_shards import ShardGroup, task_host

logger = logging.getLogger(__name__)


class ReplicaSet:
    """The replicas of one run (see the module docstring)."""

    def __init__(self, ctx: RunContext, state: RunState, shards: ShardGroup):
        self.ctx, self.state, self.shards = ctx, state, shards
        self.futures: list[Future[Any] | None] = []  # per replica index; None: not submitted, or a free elastic slot
        self.stage_futures: dict[int, list[Future[Any]]] = {}  # a pipeline's later stages, per replica
        self.driver: InGraphDriver | None = None  # in-graph replication's step driver
        self.submits = 0  # submissions so far: the attempt the shards' fencing knows each by

    # ------------------------------------------------------------------ submission
    def submit(self, only: int | None = None) -> None:
        """Submit every replica (or just ``only``), each pinned to its worker task's address."""
        ctx, plan = self.ctx, self.state.plan
        if ctx.spec.training.replication == "in_graph":
            self.driver = new_driver(ctx.client, ctx.spec, plan, self.shards.refs(), ctx.conn.tasks,
                                     f"{ctx.token}-g{self.shards.generation}", self.state.local_steps)
            self.driver.start()
            return
        refs = self.shards.refs()
        if only is None:
            self.futures = [None] * plan.num_replicas
        self.state.retired.difference_update(r.index for r in plan.replicas if only is None or r.index == only)
        self.submits += 1
        replicas = [r for r in plan.replicas if (only is None or r.index == only) and r.task in ctx.conn.tasks]
        # Fencing: this submission owns these replica indices now (its pushes carry the attempt,
        # on the socket data plane and on actor calls alike).
        self.shards.set_owners({r.index: self.submits for r in replicas})
        for r in replicas:
            addr = ctx.conn.tasks[r.task]
            if r.stage_tasks:
                self.futures[r.index] = self._submit_stages(r, refs, self._start_local_step(r.index))
                continue
            self.futures[r.index] = ctx.client.submit(
                replica_task, replica_job(ctx.spec, plan, r.index), refs, self._start_local_step(r.index),
                self.shards.data_plane, self._local_rank(r.index), attempt=self.submits, run_id=ctx.run_id,
                workers=[addr],
                allow_other_workers=False, pure=False,
                key=f"dtrain-replica-{r.index}-g{self.shards.generation}-{self.submits}-{ctx.token}")

    def _submit_stages(self, replica: ReplicaPlan, refs: list[tuple[str, str]], start: int) -> Future[Any]:
        """Submit every stage of ``replica``; returns the first stage's future."""
        ctx, plan, attempt = self.ctx, self.state.plan, self.submits
        secret = self.state.stage_secret
        tls = bool(self.shards.tls)
        base = f"{ctx.token}-g{self.shards.generation}-{attempt}-r{replica.index}"
        keys = {p: f"dtrain-stage-{base}-p{p}" for p in range(1, plan.stage_positions)}
        opening = {p: ctx.client.submit(open_stage_listener, keys[p], secret, tls, link_shape(ctx.spec, plan, p - 1),
                                        workers=[ctx.conn.tasks[replica.stage_tasks[p]]], allow_other_workers=False,
                                        pure=False, key=f"{keys[p]}-listen")
                   for p in keys}
        links = {"secret": secret, "tls": tls, "keys": keys,
                 "endpoints": {p: tuple(f.result(timeout=ctx.spec.cluster.wait_s)) for p, f in opening.items()}}
        futures = []
        for p in range(plan.stage_positions):
            job = stage_job(ctx.spec, plan, replica.index, p)
            futures.append(ctx.client.submit(
                stage_task, job, refs, start, self.shards.data_plane, links, attempt,
                workers=[ctx.conn.tasks[replica.stage_tasks[p]]], allow_other_workers=False, pure=False,
                key=f"dtrain-stage-{base}-p{p}"))
        self.stage_futures[replica.index] = futures[1:]
        return futures[0]

    def _local_rank(self, index: int) -> int:
        """Replica ``index``'s rank among the replicas whose workers share its machine (by address
        host), for ``training.pin_cpus``."""
        tasks, plan = self.ctx.conn.tasks, self.state.plan

        def host(task: str) -> str:
            return task_host(tasks[task])

        mine = host(plan.replicas[index].task)
        return [r.index for r in plan.replicas if r.task in tasks and host(r.task) == mine].index(index)

    def _start_local_step(self, index: int) -> int:
        """Where replica ``index`` resumes in its data order: in sync mode without backups every
        replica contributes once per step, so its local step is the global step; otherwise the last
        local step it reported to ps task 0."""
        state = self.state
        if state.plan.lockstep:
            step = self._ps_step()
        else:
            local: dict[Any, int] = state.local_steps
            step = int(local.get(index, local.get(str(index), 0)))
        total = data_report.total_batches(self.ctx.spec, state.plan, index)
        return step if total is None else min(step, total)  # a replica retired at the end of its data

    def _ps_step(self) -> int:
        """The ps's own step (the polled ``global_step`` may lag it by ~0.1 s of steps)."""
        try:
            return max(self.shards.steps(timeout=10))
        except Exception:  # a lost shard: what was seen last
            return self.state.global_step

    # ------------------------------------------------------------------ watching
    def failure(self) -> str | None:
        """The first replica (or pipeline stage) that failed or was cancelled, as a message."""
        if self.driver is not None:
            return self.driver.error()
        for r, fut in zip(self.state.plan.replicas, self.futures, strict=True):
            if fut is not None and (failed := describe_failure(fut, f"replica {r.index} on {r.task}")):
                return failed
        for index, futures in self.stage_futures.items():
            task = self.state.plan.replicas[index].stage_tasks
            for p, fut in enumerate(futures, start=1):
                if failed := describe_failure(fut, f"replica {index} stage {p} on {task[p]}"):
                    return failed
        return None

    def first_error(self) -> BaseException | None:
        """The error of the first replica (or pipeline stage) task that failed, if any."""
        for f in [*self.futures, *self.stages_of()]:
            if f is not None and f.status == "error":
                err: BaseException | None = f.exception(timeout=5)
                return err
        return None

    def stages_of(self, replicas: list[int] | None = None) -> list[Future[Any]]:
        """The later stages' futures (of ``replicas``, default all)."""
        return [f for i, fs in self.stage_futures.items() if replicas is None or i in replicas for f in fs]

    def live(self) -> list[int]:
        """The replica slots a worker serves now."""
        return [r.index for r in self.state.plan.replicas if r.task in self.ctx.conn.tasks]

    def finished(self) -> list[int]:
        """Replicas that ended on their own and are not retired yet (none with in-graph replication:
        the driver counts the steps)."""
        if self.driver is not None:
            return []
        return [r.index for r, f in zip(self.state.plan.replicas, self.futures, strict=True)
                if f is not None and f.status == "finished" and r.index not in self.state.retired]

    def done(self) -> bool:
        """Whether the run's replicas (or the step driver) are all done."""
        if self.driver is not None:
            return self.driver.done()
        return any(self.futures) and all(f.status == "finished" for f in self.futures if f)

    def results(self) -> list[dict[str, Any]]:
        """Each replica's stats once done (a pipeline replica's later stages' in ``extra["stages"]``)."""
        if self.driver is not None:
            return self.driver.replica_stats()
        stats = [f.result() if f is not None else {} for f in self.futures]
        for index, futures in self.stage_futures.items():
            if index < len(stats):
                stats[index].setdefault("extra", {})["stages"] = [f.result(timeout=30) for f in futures]
        return stats

    # ------------------------------------------------------------------ ending
    def stale(self, everything: bool, lost: list[int]) -> list[Future[Any]]:
        """The futures a recovery cancels: every replica's (``everything``), or the ``lost`` ones'."""
        return [f for i, f in enumerate(self.futures) if f is not None and (everything or i in lost)] + \
            self.stages_of(None if everything else lost)

    def all_futures(self) -> list[Future[Any]]:
        return [f for f in self.futures if f is not None] + self.stages_of()

    def abort_driver(self) -> None:
        """Cancel the step driver's steps in flight (no late apply on a restored shard) and drop it."""
        if self.driver is not None:
            self.driver.abort()
            self.driver.join(10)
            self.driver = None

    def leave(self, index: int) -> bool:
        """An elastic slot's worker left: its replica's future is cancelled and dropped, unless it
        had finished (its work done: its stats are kept). Says whether it had."""
        fut = self.futures[index]
        if fut is not None and fut.status == "finished":
            return True
        self.futures[index] = None
        if fut is not None:
            try:
                self.ctx.client.cancel([fut], force=True)
            except Exception as exc:  # its worker is gone anyway
                logger.debug("cancel of replica %d failed: %s", index, exc)
        return False

    def cancel(self, grace_s: float = 3.0) -> None:
        """End a run that did not complete. The order matters: replicas are first asked to stop
        (each sees it in its next reply and returns), given ``grace_s`` to do so, and only then is
        the data plane closed and what is left cancelled. Closing the data plane under a running
        replica fails its task, and its worker prints Dask's "Compute Failed" with a traceback."""
        if self.driver is not None:
            self.driver.stop()
        futures = self.all_futures() + [f for f in self.shards.futures if f is not None]
        running = [f for f in self.all_futures() if not f.done()]
        if futures:
            self.shards.request_stop()
        if running:
            with contextlib.suppress(Exception):  # a replica blocked on a lost ps: cancelled below
                wait_futures(running, timeout=grace_s)
        self.shards.close_data_plane()
        if futures:
            try:
                self.ctx.client.cancel(futures, force=True)
            except Exception as exc:
                logger.debug("cancel failed: %s", exc)
