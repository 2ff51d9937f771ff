"""Recovery from lost tasks, like MonitoredTrainingSession after a preempted ps.

:class:`Recovery` decides what was lost (a ps shard's actor erred or its worker left the
scheduler; a replica's worker left), and restarts it:

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dtrain.chief import checkpoint as ckpt_io
from dtrain.chief import stages
from dtrain.deploy.cluster import wait_for_tasks
from dtrain.spec.errors import RunError, TransientError

if TYPE_CHECKING:  # pragma: no cover
    from dtrain.chief.session import Session

logger = logging.getLogger(__name__)


def is_transient(exc: BaseException | None) -> bool:
    """Whether ``exc`` is one the session recovers from (TF's AbortedError and UnavailableError):
    a :class:`~dtrain.spec.errors.TransientError` (dtrain.Aborted, dtrain.Unavailable), a sync
    barrier that timed out, a timeout, or a connection refused or closed (on Dask's comms, or the
    socket data plane's :class:`~dtrain.dataplane.protocol.DataPlaneUnavailable`). Everything else
    (a replica's own error, a hook's RuntimeError, a full disk, non-finite parameters, a data-plane
    handshake refused) is not."""
    from distributed.comm.core import CommClosedError

    from dtrain.dataplane.protocol import DataPlaneUnavailable
    from dtrain.ps.shard import BarrierTimeout

    return isinstance(exc, (TransientError, BarrierTimeout, TimeoutError, ConnectionError, CommClosedError,
                            DataPlaneUnavailable))


class Recovery:
    """Lost-task detection and restarts for one session (see the module docstring)."""

    def __init__(self, session: Session):
        self.session = session
        self.count = 0
        self.log: list[dict[str, Any]] = []
        self.lost_stage_tasks: dict[int, list[str]] = {}

    def lost_tasks(self) -> tuple[list[int], list[int]]:
        """(lost shard indices, lost replica indices): their worker left the scheduler, or the
        actor's future erred (the scheduler reports a dead actor worker within ~0.1 s)."""
        s = self.session
        try:
            live = set(s.conn.workers())
        except Exception:  # scheduler unreachable: nothing to recover to
            raise RunError("lost the connection to the scheduler") from None
        tasks = s.conn.tasks
        shards = [sh.index for sh, f in zip(s.plan.shards, s.shards.futures, strict=True)
                  if f.status == "error" or tasks.get(sh.task) not in live]
        # A pipeline replica is lost with any of its stage tasks (named in the log by the lost ones).
        self.lost_stage_tasks = {r.index: [t for t in r.stage_tasks if tasks.get(t) not in live]
                                 for r in s.plan.replicas if r.stage_tasks}
        if s.elastic is not None:  # a replica's worker that left is a leave, not a loss (chief/elastic.py)
            return shards, []
        return shards, [r.index for r in s.plan.replicas
                        if any(tasks.get(t) not in live for t in (r.stage_tasks or (r.task,)))]

    def check(self) -> bool:
        """Recover now if a task was lost; say whether one was."""
        lost_shards, lost_replicas = self.lost_tasks()
        if lost_shards or lost_replicas:
            self.recover(lost_shards, lost_replicas)
            return True
        return False

    def recover_if_lost(self, exc: BaseException, wait_s: float = 3.0) -> bool:
        """After a failed actor call: recover if a task was lost (the scheduler may need a moment
        to notice a dead worker), and say whether it was."""
        deadline = time.monotonic() + wait_s
        while True:
            lost_shards, lost_replicas = self.lost_tasks()
            if lost_shards or lost_replicas:
                logger.info("%s: %s", type(exc).__name__, exc)
                self.recover(lost_shards, lost_replicas)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a coordinator action that calls the ps; a lost task or a transient error turns into a
        recovery."""
        try:
            return fn(*args)
        except RunError:
            raise
        except Exception as exc:
            if not (self.recover_if_lost(exc) or self.recover_if_transient(exc)):
                raise
            return None

    def recover_if_transient(self, exc: BaseException | None) -> bool:
        """After an error while every task lives: a transient one (:func:`is_transient`) restarts the
        session from the newest checkpoint; say whether it did."""
        if exc is None or not is_transient(exc):
            return False
        # A timeout or a broken connection is often the first sign of a lost task: give the
        # scheduler a moment to notice, and then recover that loss (only what was lost restarts).
        if self.recover_if_lost(exc, wait_s=2.0):
            return True
        self.recover([], [], error=exc)
        return True

    def replica_error(self) -> BaseException | None:
        """The error of the first replica (or pipeline stage) task that failed, if any."""
        s = self.session
        for f in [*s.replica_futures, *stages.futures_of(s)]:
            if f is not None and f.status == "error":
                err: BaseException | None = f.exception(timeout=5)
                return err
        return None

    def recover(self, lost_shards: list[int], lost_replicas: list[int], error: BaseException | None = None) -> None:
        """Restart what was lost (or, after a transient ``error``, everything); a task lost again
        while restarting (another worker died, the restarted one died), or a transient error then,
        is a further recovery within ``training.max_recoveries``."""
        while True:
            try:
                self._recover_once(lost_shards, lost_replicas, error)
                return
            except RunError:
                raise
            except Exception as exc:
                lost_shards, lost_replicas = self.lost_tasks()
                if not (lost_shards or lost_replicas or is_transient(exc)):
                    raise
                error = None if lost_shards or lost_replicas else exc
                logger.warning("%s again while recovering (%s: %s)", "an error" if error else "lost a task",
                               type(exc).__name__, exc)

    def _recover_once(self, lost_shards: list[int], lost_replicas: list[int], error: BaseException | None = None
                      ) -> None:
        s = self.session
        t_lost = time.time()
        step_lost = s.global_step  # the global step when the loss was seen (the chief's last poll)
        lost = [s.plan.shards[i].task for i in lost_shards] + [
            t for i in lost_replicas for t in (self.lost_stage_tasks.get(i) or [s.plan.replicas[i].task])]
        for h in s.hooks:  # before anything else: the hooks hear of every loss, the last one too
            for task in lost:
                h.on_task_lost(task)
        self.count += 1
        limit = s.spec.training.max_recoveries
        what = f"lost {', '.join(lost)}" if lost else f"{type(error).__name__}: {error}"
        if self.count > limit:
            raise RunError(f"{what}; recovery attempts used up (training.max_recoveries: {limit})") from error
        logger.warning("%s at global step %d; recovering (%d/%d)", what, step_lost, self.count, limit)
        record: dict[str, Any] = {"lost": lost, "step": step_lost, "time": t_lost}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        self.log.append(record)
        s.saver.commit_pending()  # (a checkpoint the shards were writing: committed when they are all still there)
        # A lost ps, any loss in in-graph replication (its step in flight is lost with it), or a
        # transient error (TF's recoverable session: a new session from the newest checkpoint):
        # every shard restarts from the newest checkpoint, with the step driver or every replica.
        restart = bool(lost_shards) or s.driver is not None or error is not None
        stale = [f for i, f in enumerate(s.replica_futures) if restart or i in lost_replicas]
        stale += stages.futures_of(s, None if restart else lost_replicas)
        if not restart:
            self._grant_barrier_grace()
            if s.spec.training.mode == "sync":
                s.shards.excuse(lost_replicas)
        else:
            stale += self._end_generation()
        s.client.cancel([f for f in stale if f is not None], force=True)
        wait_for_tasks(s.conn, s.spec, s.spec.cluster.wait_s)
        s.plan = s.shards.plan = s.compile_plan()
        if not restart and s.spec.training.mode == "sync" and len(set(steps := s.shards.level(lost_replicas))) > 1:
            # The lost replicas left a step half-pushed that no other replica's gradients complete (a
            # lone replica's; a pipeline stage's, whose shards only it pushes to): replacements would
            # start from parameters of two steps, so the shards restart from the newest checkpoint.
            logger.warning("the shards are at steps %s after the loss, which no replica can complete; restarting "
                           "from the newest checkpoint", steps)
            record["unlevel_steps"] = steps
            restart = True
            s.client.cancel(self._end_generation() + list(s.replica_futures) + stages.futures_of(s), force=True)
        if restart:
            s.shards.generation += 1
            latest = ckpt_io.latest(s.run_dir) if s.spec.checkpoint is not None else None
            if latest is None:
                logger.warning("no checkpoint to restore: the ps restarts from the initial parameters (step 0); "
                               "add a checkpoint section to lose at most its interval")
                s.global_step = 0
                s.local_steps = {}
            s.start_generation(latest)
            record["restored_step"] = latest.step if latest is not None else 0
        else:
            s.write_cluster_info()
            for i in lost_replicas:
                s.submit_replicas(only=i)
            record["restored_step"] = None  # nothing restored: the ps kept its step
        record["recovered_s"] = time.time() - t_lost

    def _end_generation(self) -> list[Any]:
        """Like MonitoredTrainingSession after a ps preemption, before a new session from the newest
        checkpoint (so that all shards agree on one step): stop every shard and the step driver, close
        the data plane; returns the shards' futures, to cancel."""
        s = self.session
        s.shards.request_stop()
        if s.driver is not None:
            s.driver.abort()  # cancel steps in flight: no late apply on a restored shard
            s.driver.join(10)
            s.driver = None
        s.shards.close_data_plane()
        return list(s.shards.futures)

    def _grant_barrier_grace(self) -> None:
        """A lost replica's replacement needs a worker restart, imports and data loading before its
        first push, and sync barriers (and the staleness gate) wait for it: let the surviving
        replicas' waits outlast barrier_timeout_s by up to call_timeout_s - 5 s (their own calls
        give up at call_timeout_s + barrier_timeout_s)."""
        t = self.session.spec.training
        if t.mode != "sync" and t.max_staleness is None:
            return
        self.session.shards.grant_barrier_grace(max(0.0, t.call_timeout_s - 5.0))
