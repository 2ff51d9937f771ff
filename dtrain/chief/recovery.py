"""Recovery from lost tasks, like MonitoredTrainingSession after a preempted ps.

:class:`Recovery` decides what was lost (a ps shard's actor erred or its worker left the
scheduler; a replica's worker left) and what should happen, and the session carries it out
(STYLE.md item 3: decisions out, the I/O layer acts). :meth:`Recovery.check`,
:meth:`~Recovery.lost_after` and :meth:`~Recovery.transient` find a :class:`Loss`;
:meth:`Recovery.decide` counts and logs it, tears down what it ends (the lost tasks' futures, or a
whole generation of shards) and returns a :class:`Restart` (new shards from a checkpoint, every
replica) or a :class:`Resubmit` (these replicas only), which the session carries out; a failure
while it does so is :meth:`Recovery.again`'s to judge. What happens:

- a lost **ps** task: every shard is stopped and recreated on the restarted worker, all restored
  from the newest checkpoint so that they agree on one step, and every replica restarts;
- a lost **worker** task: only its replica is resubmitted once its worker is back; in sync mode
  (and with bounded staleness) the surviving replicas' barriers get a grace while it restarts,
  and a step it left half-pushed is completed without it (``ShardGroup.excuse``); when no other
  replica's gradients can complete it (a lone replica's step, a pipeline stage's), the shards would
  stay a step apart, so everything restarts from the newest checkpoint, as after a lost ps;
- in-graph replication restarts its step driver and every shard from the newest checkpoint
  after any loss (the step in flight is lost with the task);
- a **transient error** while every process lives (:func:`is_transient`: TF's Aborted and
  Unavailable, which hooks may raise too; a ps call that got no answer; a sync barrier that timed
  out; a refused or closed connection): like TF's recoverable session, everything restarts from
  the newest checkpoint, or from the initial parameters at step 0 when there is none. Any other
  error fails the run.

Each recovery is counted against ``training.max_recoveries`` and logged (``recovery_log``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from distributed import Future

from dtrain.chief import checkpoint as ckpt_io
from dtrain.deploy.cluster import wait_for_tasks
from dtrain.errors import RunError, TransientError

from .context import RunContext, RunState
from .hooks import Hook
from .ps_shards import ShardGroup
from .replicas import ReplicaSet
from .saver import Saver

logger = logging.getLogger(__name__)


def is_transient(exc: BaseException | None) -> bool:
    """Whether ``exc`` is one the session recovers from (TF's AbortedError and UnavailableError):
    a :class:`~dtrain.errors.TransientError` (dtrain.Aborted, dtrain.Unavailable), a sync
    barrier that timed out, a timeout, or a connection refused or closed (on Dask's comms, or the
    socket data plane's :class:`~dtrain.dataplane.protocol.DataPlaneUnavailable`). Everything else
    (a replica's own error, a hook's RuntimeError, a full disk, non-finite parameters, a data-plane
    handshake refused) is not."""
    from distributed.comm.core import CommClosedError

    from dtrain.dataplane.protocol import DataPlaneUnavailable
    from dtrain.ps.shard import BarrierTimeout

    return isinstance(exc, (TransientError, BarrierTimeout, TimeoutError, ConnectionError, CommClosedError,
                            DataPlaneUnavailable))


@dataclass(frozen=True)
class Loss:
    """What was lost: shard indices and replica indices, or, with none, the transient ``error``."""

    shards: list[int] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    error: BaseException | None = None


@dataclass(frozen=True)
class Restart:
    """A new generation: the shards recreated and restored from ``checkpoint`` (None: the initial
    parameters at step 0), then every replica (or the step driver) submitted again. ``record`` is
    this recovery's entry in the log."""

    checkpoint: ckpt_io.Checkpoint | None
    record: dict[str, Any]


@dataclass(frozen=True)
class Resubmit:
    """The lost ``replicas`` submitted again, once their workers are back; the ps kept its step."""

    replicas: list[int]
    record: dict[str, Any]


Decision = Restart | Resubmit


class Recovery:
    """Lost-task detection and the decision what to restart, for one run (the module docstring).
    It reads the run's context and state, and acts on the shard group and the replica set only to
    end what was lost; the session carries out the :class:`Restart` or :class:`Resubmit`."""

    def __init__(self, ctx: RunContext, state: RunState, shards: ShardGroup, replicas: ReplicaSet, saver: Saver,
                 hooks: list[Hook], elastic: bool = False):
        self.ctx, self.state, self.shards, self.replicas, self.saver = ctx, state, shards, replicas, saver
        self.hooks = hooks
        self.elastic = elastic  # a replica's worker that left is a leave, not a loss (chief/elastic.py)
        self.count = 0
        self.log: list[dict[str, Any]] = []
        self.lost_stage_tasks: dict[int, list[str]] = {}

    def lost(self) -> Loss | None:
        """The lost shards and replicas, if any: their worker left the scheduler, or the actor's
        future erred (the scheduler reports a dead actor worker within ~0.1 s)."""
        conn, plan = self.ctx.conn, self.state.plan
        try:
            live = set(conn.workers())
        except RunError:  # the scheduler does not answer (cluster.scheduler_timeout_s): said as is
            raise
        except Exception:  # scheduler unreachable: nothing to recover to
            raise RunError("lost the connection to the scheduler") from None
        tasks = conn.tasks
        # (a creation that failed part-way, its worker lost, has no actor for the later shards)
        futures = self.shards.futures
        shards = [sh.index for j, sh in enumerate(plan.shards)
                  if tasks.get(sh.task) not in live or (j < len(futures) and futures[j].status == "error")]
        # A pipeline replica is lost with any of its stage tasks (named in the log by the lost ones).
        self.lost_stage_tasks = {r.index: [t for t in r.stage_tasks if tasks.get(t) not in live]
                                 for r in plan.replicas if r.stage_tasks}
        replicas = [] if self.elastic else [
            r.index for r in plan.replicas if any(tasks.get(t) not in live for t in (r.stage_tasks or (r.task,)))]
        return Loss(shards, replicas) if shards or replicas else None

    def check(self) -> Loss | None:
        """A task lost now, if any (the session's liveness check)."""
        return self.lost()

    def lost_after(self, exc: BaseException, wait_s: float = 3.0) -> Loss | None:
        """After a failed actor call: a task that was lost (the scheduler may need a moment to
        notice a dead worker), if any."""
        deadline = time.monotonic() + wait_s
        while True:
            loss = self.lost()
            if loss is not None:
                logger.info("%s: %s", type(exc).__name__, exc)
                return loss
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def transient(self, exc: BaseException | None) -> Loss | None:
        """After an error while every task lives: a transient one (:func:`is_transient`) is a loss
        of everything (a restart from the newest checkpoint); None for any other error."""
        if exc is None or not is_transient(exc):
            return None
        # A timeout or a broken connection is often the first sign of a lost task: give the
        # scheduler a moment to notice, and then recover that loss (only what was lost restarts).
        return self.lost_after(exc, wait_s=2.0) or Loss(error=exc)

    def after_error(self, exc: BaseException) -> Loss | None:
        """After a coordinator action that calls the ps failed: a lost task or a transient error, if
        either (the session then recovers; otherwise the error stands)."""
        return self.lost_after(exc) or self.transient(exc)

    def again(self, exc: BaseException) -> Loss | None:
        """``exc`` was raised while recovering: a task lost again (another worker died, the
        restarted one died), or a transient error, is a further recovery within
        ``training.max_recoveries``; None: the error stands."""
        loss = self.lost()
        if loss is None and not is_transient(exc):
            return None
        logger.warning("%s again while recovering (%s: %s)", "lost a task" if loss else "an error",
                       type(exc).__name__, exc)
        return loss or Loss(error=exc)

    def decide(self, loss: Loss) -> Decision:
        """Count and log ``loss``, end what it ends, and say what to start again (RunError once
        ``training.max_recoveries`` is used up)."""
        plan, spec = self.state.plan, self.ctx.spec
        lost_shards, lost_replicas, error = loss.shards, loss.replicas, loss.error
        t_lost = time.time()
        step_lost = self.state.global_step  # the global step when the loss was seen (the chief's last poll)
        lost = [plan.shards[i].task for i in lost_shards] + [
            t for i in lost_replicas for t in (self.lost_stage_tasks.get(i) or [plan.replicas[i].task])]
        for h in self.hooks:  # before anything else: the hooks hear of every loss, the last one too
            for task in lost:
                h.on_task_lost(task)
        self.count += 1
        limit = spec.training.max_recoveries
        what = f"lost {', '.join(lost)}" if lost else f"{type(error).__name__}: {error}"
        if self.count > limit:
            raise RunError(f"{what}; recovery attempts used up (training.max_recoveries: {limit})") from error
        logger.warning("%s at global step %d; recovering (%d/%d)", what, step_lost, self.count, limit)
        record: dict[str, Any] = {"lost": lost, "step": step_lost, "time": t_lost}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        self.log.append(record)
        self.saver.commit_pending()  # (a checkpoint the shards were writing: committed when they are all still there)
        # A lost ps, any loss in in-graph replication (its step in flight is lost with it), or a
        # transient error (TF's recoverable session: a new session from the newest checkpoint):
        # every shard restarts from the newest checkpoint, with the step driver or every replica.
        restart = bool(lost_shards) or self.replicas.driver is not None or error is not None
        stale = self.replicas.stale(restart, lost_replicas)
        if not restart:
            self._grant_barrier_grace()
            if spec.training.mode == "sync":
                self.shards.excuse(lost_replicas)
        else:
            stale += self._end_generation()
        self.ctx.client.cancel(stale, force=True)
        before = dict(self.ctx.conn.tasks)
        wait_for_tasks(self.ctx.conn, spec, spec.cluster.wait_s, plan=self.state.plan)
        if not restart:
            # wait_for_tasks points every task at its worker now: a task whose worker was restarted
            # (a new address) since the loss was seen was lost too, though no later check can tell
            # any more; its replica's task, pinned to the old address, would wait for it forever.
            moved = self._moved(before, lost_replicas)
            if moved["shards"]:
                restart = True
                self.ctx.client.cancel(self._end_generation() + self.replicas.stale(True, []), force=True)
            elif moved["replicas"]:
                lost_replicas = [*lost_replicas, *moved["replicas"]]
                self.ctx.client.cancel(self.replicas.stale(False, moved["replicas"]), force=True)
                if spec.training.mode == "sync":
                    self.shards.excuse(moved["replicas"])
            if moved["tasks"]:
                logger.warning("lost %s too while recovering (restarted at another address)", ", ".join(moved["tasks"]))
                record["lost"] = [*lost, *moved["tasks"]]
                for h in self.hooks:
                    for task in moved["tasks"]:
                        h.on_task_lost(task)
        if not restart and spec.training.mode == "sync" and len(set(steps := self.shards.level(lost_replicas))) > 1:
            # The lost replicas left a step half-pushed that no other replica's gradients complete (a
            # lone replica's; a pipeline stage's, whose shards only it pushes to): replacements would
            # start from parameters of two steps, so the shards restart from the newest checkpoint.
            logger.warning("the shards are at steps %s after the loss, which no replica can complete; restarting "
                           "from the newest checkpoint", steps)
            record["unlevel_steps"] = steps
            restart = True
            self.ctx.client.cancel(self._end_generation() + self.replicas.stale(True, []), force=True)
        if not restart:
            record["restored_step"] = None  # nothing restored: the ps kept its step
            return Resubmit(list(lost_replicas), record)
        latest = ckpt_io.latest(self.ctx.run_dir) if spec.checkpoint is not None else None
        if latest is None:
            logger.warning("no checkpoint to restore: the ps restarts from the initial parameters (step 0); "
                           "add a checkpoint section to lose at most its interval")
        record["restored_step"] = latest.step if latest is not None else 0
        return Restart(latest, record)

    def _moved(self, before: dict[str, str], lost_replicas: list[int]) -> dict[str, Any]:
        """The shards and the replicas (other than ``lost_replicas``) whose task's worker address
        changed from ``before`` (and those tasks): lost while the recovery waited for its workers."""
        plan, now = self.state.plan, self.ctx.conn.tasks
        gone = {t for t, a in before.items() if now.get(t) != a}
        shards = [sh.index for sh in plan.shards if sh.task in gone]
        futures = self.replicas.futures
        done = {i for i, f in enumerate(futures) if f is not None and f.status == "finished"}  # (nothing waits)
        replicas = [] if self.elastic else [r.index for r in plan.replicas if r.index not in lost_replicas
                                            and r.index not in done and gone & set(r.stage_tasks or (r.task,))]
        tasks = [plan.shards[i].task for i in shards] + [
            t for i in replicas for t in (plan.replicas[i].stage_tasks or (plan.replicas[i].task,)) if t in gone]
        return {"shards": shards, "replicas": replicas, "tasks": tasks}

    def recovered(self, decision: Decision) -> None:
        """The session carried ``decision`` out: the log says how long the recovery took."""
        decision.record["recovered_s"] = time.time() - decision.record["time"]

    def _end_generation(self) -> list[Future[Any]]:
        """Like MonitoredTrainingSession after a ps preemption, before a new session from the newest
        checkpoint (so that all shards agree on one step): stop every shard and the step driver, close
        the data plane; returns the shards' futures, to cancel."""
        self.shards.request_stop()
        self.replicas.abort_driver()  # cancel steps in flight: no late apply on a restored shard
        self.shards.close_data_plane()
        return list(self.shards.futures)

    def _grant_barrier_grace(self) -> None:
        """A lost replica's replacement needs a worker restart, imports and data loading before its
        first push, and sync barriers (and the staleness gate) wait for it: let the surviving
        replicas' waits outlast barrier_timeout_s by up to call_timeout_s - 5 s (their own calls
        give up at call_timeout_s + barrier_timeout_s)."""
        t = self.ctx.spec.training
        if t.mode != "sync" and t.max_staleness is None:
            return
        self.shards.grant_barrier_grace(max(0.0, t.call_timeout_s - 5.0))
