"""The monitored training session: the chief that turns a Plan into Dask calls.

It creates one ParameterShard actor per shard on its task's worker, initialises the variables
(seeded), submits one long-running replica future per worker task (pinned by address, never
stolen), follows progress by polling ps task 0 a few times a second (replicas are never slowed
by it), runs the hooks, evaluates, and writes the run directory (DESIGN.md's contract).
Only this module and ``tasks.py``/``cluster.py`` talk to Dask; the tensor math lives in
``ps.py``, ``replica.py`` and ``layout.py``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from distributed import Client, Future

from dtrain.deploy.cluster import Connection, connect, wait_for_tasks
from dtrain.model.layers import build_model
from dtrain.plan.compiler import Plan, compile
from dtrain.plan.layout import ShardLayout
from dtrain.ps.shard import ParameterShard
from dtrain.spec.errors import RunDirError, RunError, Terminated
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.replica import dataset_for, evaluate
from dtrain.worker.tasks import replica_task

from . import checkpoint as ckpt_io
from .hooks import Hook, NanGuardHook, StepContext, build_hooks
from .metrics import JsonlSink, TensorBoardSink

logger = logging.getLogger(__name__)

POLL_S = 0.1


@dataclass
class Result:
    """What ``dtrain.run`` returns: the summary (as written to summary.json), the trained model
    (for a training pipeline), the fetched values (for a graph pipeline) and the run directory."""

    summary: dict[str, Any]
    model: torch.nn.Module | None = None
    run_dir: Path | None = None
    fetched: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    replica_stats: list[dict[str, Any]] = field(default_factory=list)


def default_run_dir(spec: PipelineSpec) -> Path:
    return Path("runs") / spec.name


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A run directory holding checkpoints is never overwritten silently (exit 2 via RunDirError)."""
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*.pt")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts and not resume:
        raise RunDirError(f"{run_dir} already holds {len(ckpts)} checkpoint(s) (newest {ckpts[-1].name}); "
                          "pass --resume to continue from it, or choose another --run-dir")


def run(spec: PipelineSpec, client: Client | None = None, run_dir: str | Path | None = None, *,
        scheduler: str | None = None, resume: bool = False, progress: Callable[[dict[str, Any]], None] | None = None,
        processes: bool = True) -> Result:
    """Run a pipeline. With ``client``, on that client's cluster (it must have a worker per task,
    named ``<job>-<index>`` or tagged with the resource ``<job>``); otherwise on
    ``scheduler``/``cluster.scheduler``, or on an embedded cluster started (and stopped) here."""
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(spec)
    check_run_dir(run_dir, resume)
    if spec.is_graph:
        from dtrain.graph.runner import run_graph

        return run_graph(spec, client=client, scheduler=scheduler, processes=processes, run_dir=run_dir)
    hooks = build_hooks(spec.hooks)  # a bad custom hook is a SpecError: before anything starts
    with connect(spec, client=client, scheduler=scheduler, processes=processes) as conn:
        session = Session(spec, conn, run_dir, resume=resume, progress=progress, hooks=hooks)
        # Actor handles find their client through the "current client" (this is not made the
        # process-wide default client, which belongs to the user).
        with conn.client.as_current():
            return session.run()


class Session:
    """One training run on a connected cluster (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, conn: Connection, run_dir: Path, resume: bool = False,
                 progress: Callable[[dict[str, Any]], None] | None = None, hooks: list[Hook] | None = None):
        self.spec = spec
        self.conn = conn
        self.client = conn.client
        self.run_dir = run_dir
        self.resume = resume
        self.progress = progress
        self.plan = compile(spec, conn.workers())
        if self.plan.missing_tasks:
            raise RunError("no worker for task(s) " + ", ".join(self.plan.missing_tasks))
        self.layout = ShardLayout.from_plan(self.plan)
        self.token = uuid.uuid4().hex[:8]
        self.generation = 0
        self.hooks: list[Hook] = build_hooks(spec.hooks) if hooks is None else hooks
        self.start_step = 0
        self.global_step = 0
        self.recoveries = 0
        self.dropped_stale = 0
        self.samples = 0
        self.records: list[dict[str, Any]] = []
        self.shards: list[Any] = []
        self.shard_futures: list[Future] = []
        self.replica_futures: list[Future] = []
        self.sinks: list[Any] = []
        self.eval_history: list[dict[str, Any]] = []
        self.driver: Any = None  # in-graph replication's step driver
        self.local_steps: dict[Any, int] = {}
        self._submits = 0
        self.recovery_log: list[dict[str, Any]] = []
        # Replica connections the ps data planes served (all generations), and through shared memory.
        self.data_plane_counts = {"connections": 0, "shared_memory_connections": 0}
        self.checkpoints_written: list[str] = []
        self._last_ckpt_step = 0
        self._last_ckpt_time = time.monotonic()

    # ------------------------------------------------------------------ ps
    def _shard_config(self, index: int) -> dict[str, Any]:
        t = self.spec.training
        return {
            "index": index, "mode": t.mode, "steps": t.steps, "generation": self.generation,
            "holds_global_step": self.plan.shards[index].holds_global_step,
            "barrier_timeout_s": t.barrier_timeout_s, "summary_every": self.spec.summary.every_steps,
            "nan_guard": any(isinstance(h, NanGuardHook) for h in self.hooks),
            "num_replicas": self.plan.num_replicas, "replicas_to_aggregate": self.plan.replicas_to_aggregate,
            "max_staleness": t.max_staleness, "optimizer": self.spec.optimizer.model_dump(),
            "torch_threads": t.torch_threads,
        }

    def create_shards(self, init: list[torch.Tensor]) -> None:
        """One actor per shard, pinned to its task's worker address."""
        self.shards, self.shard_futures = [], []
        for shard, values in zip(self.plan.shards, init, strict=True):
            addr = self.conn.tasks[shard.task]
            data = self.client.scatter(values, workers=[addr], direct=True, hash=False)
            fut = self.client.submit(ParameterShard, self._shard_config(shard.index), data, actor=True,
                                     workers=[addr], allow_other_workers=False, pure=False,
                                     key=f"dtrain-ps-{shard.index}-g{self.generation}-{self.token}")
            self.shard_futures.append(fut)
        self.shards = [f.result(timeout=self.spec.cluster.wait_s) for f in self.shard_futures]
        self.data_plane = None
        if self.spec.training.transport == "socket" and self.spec.training.replication == "between_graph":
            self.data_plane = self._open_data_plane()

    def _open_data_plane(self) -> dict[str, Any]:
        """Each ps actor opens a listener on its worker's host; replicas get the endpoints and a
        per-run secret through Dask (the control plane: TLS-protected when the cluster is)."""
        import secrets

        tls = None
        sec = self.spec.cluster.security
        if sec is not None:
            from dtrain.deploy.cluster import security_paths

            files = security_paths(self.spec) or {}
            tls = {name: (Path(files[f"{name}_file"]).read_text() if files.get(f"{name}_file") else None)
                   for name in ("ca", "cert", "key")}
        secret = getattr(self, "_secret", None) or secrets.token_bytes(32)
        self._secret = secret
        endpoints = []
        for shard, handle in zip(self.plan.shards, self.shards, strict=True):
            host = self._task_host(shard.task)
            endpoints.append(tuple(self._call(handle.open_data_plane(secret, host, tls,
                                                                     self.spec.training.wire_dtype))))
        return {"endpoints": endpoints, "secret": secret, "tls": tls, "wire_dtype": self.spec.training.wire_dtype,
                "shared_memory": self.spec.training.shared_memory}

    def close_data_plane(self) -> None:
        if getattr(self, "data_plane", None) is None:
            return
        counts = self.data_plane_counts
        for s in self.shards:
            try:
                served = self._call(s.close_data_plane(), timeout=5)
                counts["connections"] += served["connections"]
                counts["shared_memory_connections"] += served["shared_memory"]
            except Exception as exc:  # a lost shard's listener died with its process
                logger.debug("close_data_plane failed: %s", exc)
        self.data_plane = None

    def restore(self, checkpoint: ckpt_io.Checkpoint) -> None:
        """Set every shard (params, optimizer state, step) from one checkpoint."""
        states = checkpoint.payload["shards"]
        if len(states) != len(self.shards) or any(
                st["params"].numel() != s.numel for st, s in zip(states, self.plan.shards, strict=True)):
            raise RunError(f"{checkpoint.path} was written for a different model or placement "
                           f"({len(states)} shard(s)); use another --run-dir")
        for shard, state in zip(self.shards, states, strict=True):
            self._call(shard.set_state(state))

    def shard_refs(self) -> list[tuple[str, str]]:
        return [(self.conn.tasks[s.task], f.key) for s, f in zip(self.plan.shards, self.shard_futures, strict=True)]

    def _call(self, future: Any, timeout: float = 30.0) -> Any:
        return future.result(timeout=timeout)

    def pull_params(self) -> list[torch.Tensor]:
        return [self._call(s.get_params())[0] for s in self.shards]

    def request_stop(self) -> None:
        for s in self.shards:
            try:
                self._call(s.request_stop(), timeout=10)
            except Exception as exc:  # a lost shard cannot be stopped; its replicas time out
                logger.debug("request_stop failed: %s", exc)

    # ------------------------------------------------------------------ replicas
    def submit_replicas(self, only: int | None = None) -> None:
        """Submit every replica (or just ``only``), each pinned to its worker task's address."""
        if self.spec.training.replication == "in_graph":
            from .ingraph import InGraphDriver

            self.driver = InGraphDriver(self.client, self.spec, self.plan, self.shard_refs(), self.conn.tasks,
                                        f"{self.token}-g{self.generation}")
            self.driver.start()
            return
        refs = self.shard_refs()
        if only is None:
            self.replica_futures = [None] * self.plan.num_replicas  # type: ignore[list-item]
        self._submits += 1
        for r in self.plan.replicas:
            if only is not None and r.index != only:
                continue
            addr = self.conn.tasks[r.task]
            self.replica_futures[r.index] = self.client.submit(
                replica_task, self.spec, self.plan, r.index, refs, self._start_local_step(r.index),
                self.data_plane, self._local_rank(r.index), workers=[addr], allow_other_workers=False, pure=False,
                key=f"dtrain-replica-{r.index}-g{self.generation}-{self._submits}-{self.token}")

    def _task_host(self, task: str) -> str:
        """The host of ``task``'s worker address (``tcp://[::1]:4000`` -> ``::1``)."""
        return self.conn.tasks[task].split("://")[-1].rsplit(":", 1)[0].strip("[]")

    def _local_rank(self, index: int) -> int:
        """Replica ``index``'s rank among the replicas whose workers share its machine (by address
        host), for ``training.pin_cpus``."""
        mine = self._task_host(self.plan.replicas[index].task)
        return [r.index for r in self.plan.replicas if self._task_host(r.task) == mine].index(index)

    def _start_local_step(self, index: int) -> int:
        """Where replica ``index`` resumes in its data order: in sync mode without backups every
        replica contributes once per step, so its local step is the global step; otherwise the last
        local step it reported to ps task 0."""
        if self.spec.training.mode == "sync" and self.plan.replicas_to_aggregate == self.plan.num_replicas:
            return self.global_step
        return int(self.local_steps.get(index, self.local_steps.get(str(index), 0)))

    def _replica_failure(self) -> str | None:
        if self.driver is not None:
            return self.driver.error()
        for r, fut in zip(self.plan.replicas, self.replica_futures, strict=True):
            if fut.status == "error":
                exc = fut.exception(timeout=5)
                return f"replica {r.index} on {r.task} failed: {type(exc).__name__}: {exc}"
            if fut.status == "cancelled":
                return f"replica {r.index} on {r.task} was cancelled (its worker was lost?)"
        return None

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        status, error = "failed", None
        model = None
        final_eval: dict[str, Any] = {}
        try:
            self._open_sinks()
            if self.conn.dashboard_link:
                logger.info("Dask dashboard: %s", self.conn.dashboard_link)
            torch.manual_seed(self.spec.training.seed)
            init_model = build_model(self.spec)
            self.init_buffers = self.layout.pack(dict(init_model.named_parameters()))
            latest = ckpt_io.latest(self.run_dir) if self.resume else None
            if self.resume and latest is None:
                logger.warning("--resume: no valid checkpoint in %s; starting from step 0", self.run_dir)
            self._start_generation(latest)
            self.start_step = self.global_step
            for h in self.hooks:
                h.begin(self)
            self.t_train = time.time()
            self._monitor()
            self.train_s = time.time() - self.t_train
            if self.spec.checkpoint is not None and self._last_ckpt_step != self.global_step:
                self.save_checkpoint()
            model, final_eval = self._finish(init_model)
            status = "completed"
        except KeyboardInterrupt as exc:
            status, error = "interrupted", "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
            if self.spec.checkpoint is not None and self.shards:
                try:
                    self.request_stop()
                    self.save_checkpoint()
                except Exception as ckpt_exc:  # the interrupt wins; say what was lost
                    logger.warning("could not checkpoint on interrupt: %s", ckpt_exc)
            raise
        except RunError as exc:
            error = str(exc)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise RunError(error) from exc
        finally:
            if status != "completed":
                self._cancel()
            for h in self.hooks:
                try:
                    h.end(self)
                except Exception as exc:  # a hook's failure must not hide the run's own outcome
                    logger.warning("hook %s failed at end: %s", type(h).__name__, exc)
            summary = self._summary(status, error, final_eval, time.time() - t_start)
            _write_json(self.run_dir / "summary.json", summary)
            for sink in self.sinks:
                sink.close()
        return Result(summary=summary, model=model, run_dir=self.run_dir, plan=self.plan,
                      replica_stats=list(getattr(self, "replica_stats", []) or []))

    def write_cluster_info(self) -> None:
        """``cluster.json``: scheduler, dashboard and each task's worker address and process id
        (for operators, and for fault tests that kill a task's process by pid)."""
        import os

        try:
            pids = self.client.run(os.getpid, workers=list(set(self.conn.tasks.values())))
        except Exception as exc:  # informational only
            logger.debug("could not read worker pids: %s", exc)
            pids = {}
        workers = {task: {"address": addr, "pid": pids.get(addr)} for task, addr in sorted(self.conn.tasks.items())}
        _write_json(self.run_dir / "cluster.json", {
            "scheduler": self.client.scheduler.address, "dashboard": self.conn.dashboard_link,
            "generation": self.generation, "tasks": workers})

    def _start_generation(self, checkpoint: ckpt_io.Checkpoint | None) -> None:
        """Create the ps actors (restored from ``checkpoint`` when given) and start the replicas."""
        self.write_cluster_info()
        self.create_shards(self.init_buffers)
        if checkpoint is not None:
            self.restore(checkpoint)
            self.global_step = checkpoint.step
            self._last_ckpt_step = checkpoint.step
            self.local_steps = {int(k): v for k, v in checkpoint.payload.get("replicas", {})
                                .get("local_steps", {}).items()}
            logger.info("restored %s (global step %d)", checkpoint.path.name, checkpoint.step)
        self.submit_replicas()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        """Snapshot every shard at one consistent step and write it atomically.

        Applies pause for the snapshot: in async mode at once; in sync mode at the newest step any
        shard has reached, once the lagging shards have applied it (they are at most one step
        behind, and the replicas' gradients for that step are already on their way).
        """
        spec = self.spec.checkpoint
        if spec is None:
            return None
        t0 = time.monotonic()
        try:
            self._hold_consistent()
            states = [self._call(s.get_state(), timeout=60) for s in self.shards]
        finally:
            self._release()
        if any(isinstance(h, NanGuardHook) for h in self.hooks):
            for i, st in enumerate(states):
                if not bool(torch.isfinite(st["params"]).all()):
                    raise RunError(f"nan_guard: parameters of shard {i} became non-finite at step {st['step']}; "
                                   "no checkpoint written")
        step = states[0]["step"]
        path = ckpt_io.save(self.run_dir, step, states, spec_data=self.spec.model_dump(mode="json"),
                            pipeline_hash=self.plan.pipeline_hash,
                            replicas={"local_steps": {str(k): v for k, v in self.local_steps.items()}},
                            keep=spec.keep)
        self._last_ckpt_step, self._last_ckpt_time = step, time.monotonic()
        self.checkpoints_written.append(path.name)
        logger.info("checkpoint %s (%.2f s)", path.name, time.monotonic() - t0)
        for h in self.hooks:
            h.on_checkpoint(step, str(path))
        return path

    def _hold_consistent(self) -> list[int]:
        """Pause applies with every shard at one step (see :meth:`save_checkpoint`); returns the steps."""
        if self.spec.training.mode == "async":
            return [self._call(s.hold()) for s in self.shards]
        target = max(self._call(s.hold(10**12)) for s in self.shards)
        steps: list[int] = []
        for _ in range(5):
            for s in self.shards:
                self._call(s.hold(target))
            steps = [self._call(s.wait_held(), timeout=self.spec.training.barrier_timeout_s + 5)
                     for s in self.shards]
            if min(steps) == max(steps):
                break
            target = max(steps)
        return steps

    def _release(self) -> None:
        for s in self.shards:
            try:
                self._call(s.release(), timeout=10)
            except Exception as exc:  # a lost shard: recovery will replace it
                logger.debug("release failed: %s", exc)

    def stop_consistently(self) -> None:
        """A hook's stop: in sync mode every shard stops at the same step (held first, so no step
        lands on one shard but not another); async simply stops."""
        if self.spec.training.mode == "sync":
            try:
                self._hold_consistent()
                self.request_stop()
            finally:
                self._release()
        else:
            self.request_stop()

    def _checkpoint_due(self) -> bool:
        spec = self.spec.checkpoint
        if spec is None or self.global_step == self._last_ckpt_step:
            return False
        if spec.every_steps and self.global_step // spec.every_steps > self._last_ckpt_step // spec.every_steps:
            return True
        return bool(spec.every_secs and time.monotonic() - self._last_ckpt_time >= spec.every_secs)

    # ------------------------------------------------------------------ failures and recovery
    def _lost_tasks(self) -> tuple[list[int], list[int]]:
        """(lost shard indices, lost replica indices): their worker left the scheduler, or the
        actor's future erred (the scheduler reports a dead actor worker within ~0.1 s)."""
        try:
            live = set(self.conn.workers())
        except Exception:  # scheduler unreachable: nothing to recover to
            raise RunError("lost the connection to the scheduler") from None
        shards = [s.index for s, f in zip(self.plan.shards, self.shard_futures, strict=True)
                  if f.status == "error" or self.conn.tasks.get(s.task) not in live]
        replicas = [] if self.driver is not None else [
            r.index for r in self.plan.replicas if self.conn.tasks.get(r.task) not in live]
        if self.driver is not None and any(self.conn.tasks.get(r.task) not in live for r in self.plan.replicas):
            shards = shards or [0]  # in-graph: restart the step driver from the checkpoint
        return shards, replicas

    def _recover_if_lost(self, exc: BaseException, wait_s: float = 3.0) -> bool:
        """After a failed actor call: recover if a task was lost (the scheduler may need a moment
        to notice a dead worker), and say whether it was."""
        deadline = time.monotonic() + wait_s
        while True:
            lost_shards, lost_replicas = self._lost_tasks()
            if lost_shards or lost_replicas:
                logger.info("%s: %s", type(exc).__name__, exc)
                self._recover(lost_shards, lost_replicas)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a coordinator action that calls the ps; a lost task turns into a recovery."""
        try:
            return fn(*args)
        except RunError:
            raise
        except Exception as exc:
            if not self._recover_if_lost(exc):
                raise
            return None

    def _recover(self, lost_shards: list[int], lost_replicas: list[int]) -> None:
        t_lost = time.time()
        lost = [self.plan.shards[i].task for i in lost_shards] + [self.plan.replicas[i].task for i in lost_replicas]
        self.recoveries += 1
        limit = self.spec.training.max_recoveries
        if self.recoveries > limit:
            raise RunError(f"lost {', '.join(lost)}; recovery attempts used up (training.max_recoveries: {limit})")
        for h in self.hooks:
            for task in lost:
                h.on_task_lost(task)
        logger.warning("lost %s at global step %d; recovering (%d/%d)", ", ".join(lost), self.global_step,
                       self.recoveries, limit)
        stale = [f for i, f in enumerate(self.replica_futures) if lost_shards or i in lost_replicas]
        if lost_replicas and not lost_shards:
            self._grant_barrier_grace()
            self._excuse_lost(lost_replicas)
        if lost_shards:
            # Like MonitoredTrainingSession after a ps preemption: a new session from the latest
            # checkpoint, so that all shards agree on one step.
            self.request_stop()
            if self.driver is not None:
                self.driver.abort()  # cancel steps in flight: no late apply on a restored shard
                self.driver.join(10)
                self.driver = None
            self.close_data_plane()
            stale += self.shard_futures
        self.client.cancel([f for f in stale if f is not None], force=True)
        wait_for_tasks(self.conn, self.spec, self.spec.cluster.wait_s)
        self.plan = compile(self.spec, self.conn.workers())
        if lost_shards:
            self.generation += 1
            latest = ckpt_io.latest(self.run_dir) if self.spec.checkpoint is not None else None
            if latest is None:
                self.global_step = 0
                self.local_steps = {}
            self._start_generation(latest)
        else:
            self.write_cluster_info()
            for i in lost_replicas:
                self.submit_replicas(only=i)
        self.recovery_log.append({"lost": lost, "step": self.global_step, "time": t_lost,
                                  "restored_step": self.global_step, "recovered_s": time.time() - t_lost})

    def _grant_barrier_grace(self) -> None:
        """A lost replica's replacement needs a worker restart, imports and data loading before its
        first push, and sync barriers (and the staleness gate) wait for it: let the surviving
        replicas' waits outlast barrier_timeout_s by up to call_timeout_s - 5 s (their own calls
        give up at call_timeout_s + barrier_timeout_s)."""
        t = self.spec.training
        if t.mode != "sync" and t.max_staleness is None:
            return
        grace = max(0.0, t.call_timeout_s - 5.0)
        for s in self.shards:
            try:
                self._call(s.barrier_grace(grace), timeout=5)
            except Exception as exc:  # a shard that does not answer is handled as lost next
                logger.debug("barrier_grace failed: %s", exc)

    def _excuse_lost(self, lost_replicas: list[int]) -> None:
        """Sync: a replica killed between its pushes to two shards left the shard it did not reach
        one step behind, waiting for a gradient that will never come (its replacement starts from a
        fresh pull, at the leading step), while the others cannot compute on mixed steps: every
        shard behind the leading one completes its step without the lost replicas' gradients."""
        if self.spec.training.mode != "sync" or self.driver is not None:
            return
        try:
            steps = [self._call(s.current_step(), timeout=5) for s in self.shards]
            top = max(steps)
            for s, step in zip(self.shards, steps, strict=True):
                for i in lost_replicas if step < top else []:
                    self._call(s.excuse(i, step), timeout=self.spec.training.barrier_timeout_s + 5)
        except Exception as exc:  # a shard that does not answer is handled as lost next
            logger.debug("excuse failed: %s", exc)

    def _open_sinks(self) -> None:
        self.sinks = [JsonlSink(self.run_dir / "metrics.jsonl", append=self.resume)]
        if self.spec.summary.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tb"))

    def _log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def _monitor(self) -> None:
        stopping = False
        last_step = -1
        latest: dict[str, Any] = {}
        lr = getattr(self.spec.optimizer, "lr", None)
        last_liveness = 0.0
        while True:
            now = time.monotonic()
            if now - last_liveness >= 0.25:
                last_liveness = now
                lost_shards, lost_replicas = self._lost_tasks()
                if lost_shards or lost_replicas:
                    self._recover(lost_shards, lost_replicas)
                    continue
            try:
                stats = self._call(self.shards[0].stats(), timeout=10)
            except Exception as exc:
                if not self._recover_if_lost(exc):
                    raise RunError(f"ps task 0 does not answer: {type(exc).__name__}: {exc}") from None
                continue
            if stats["generation"] != self.generation:
                continue
            self.global_step = stats["step"]
            self.dropped_stale = stats["dropped_stale"]
            self.samples = stats["samples"]
            self.local_steps.update({int(k): v for k, v in stats["local_steps"].items()})
            if self.recovery_log and "first_apply_s" not in self.recovery_log[-1] \
                    and stats["last_apply_time"] > self.recovery_log[-1]["time"]:
                rec = self.recovery_log[-1]
                rec["first_apply_s"] = stats["last_apply_time"] - rec["time"]
                logger.warning("recovered: first update %.1f s after the loss was seen", rec["first_apply_s"])
            for rec in stats["records"]:
                metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
                metrics["learning_rate"] = lr
                self._log(metrics, rec["step"])
                self.records.append(rec)
                latest = metrics
                every = self.spec.eval.every_steps
                if every and rec["step"] % every == 0 and rec["step"] < self.spec.training.steps:
                    self._guarded(self._evaluate_now, rec["step"])
            if self.global_step != last_step:
                ctx = StepContext(self.global_step, dict(latest))
                for h in self.hooks:
                    h.before_step(ctx)
                for h in self.hooks:
                    h.after_step(ctx)
                if ctx.stop_requested and not stopping:
                    logger.info("stopping: %s", ctx.stop_requested)
                    stopping = True
                    self._guarded(self.stop_consistently)
                last_step = self.global_step
            if self.progress is not None:
                self.progress({"step": self.global_step, "steps": self.spec.training.steps,
                               "loss": latest.get("loss"), "samples_per_sec": latest.get("samples_per_sec"),
                               "dropped_stale": self.dropped_stale})
            if stats["error"]:
                self.request_stop()
                raise RunError(stats["error"])
            if self._checkpoint_due():
                self._guarded(self.save_checkpoint)
            failure = self._replica_failure()
            if failure:
                lost_shards, lost_replicas = self._lost_tasks()
                if lost_shards or lost_replicas:
                    self._recover(lost_shards, lost_replicas)
                    continue
                self.request_stop()
                raise RunError(failure)
            if self.driver is not None:
                if self.driver.done():
                    break
            elif all(f.status == "finished" for f in self.replica_futures):
                break
            time.sleep(POLL_S)
        if self.driver is not None:
            self.replica_stats = self.driver.replica_stats()
        else:
            self.replica_stats = [f.result() for f in self.replica_futures]
        for r, st in zip(self.plan.replicas, self.replica_stats, strict=True):
            if "GPU" in r.device and not str(st.get("device", "")).startswith("cuda"):
                logger.warning("replica %d was placed on %s but computed on %s (placement.soft: no CUDA device "
                               "on %s)", r.index, r.device, st.get("device"), r.task)
        final = self._call(self.shards[0].stats(), timeout=30)
        self.global_step, self.dropped_stale, self.samples = final["step"], final["dropped_stale"], final["samples"]
        for rec in final["records"]:
            self._log({k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}, rec["step"])
            self.records.append(rec)
        if final["error"]:  # nan_guard fired after the last poll
            raise RunError(final["error"])

    def _evaluate_now(self, step: int) -> dict[str, Any]:
        model = self._assemble(build_model(self.spec), self.pull_params())
        result = self._eval(model)
        if result:
            self._log({"eval": result}, step)
            self.eval_history.append({"step": step, **result})
        return result

    def _eval(self, model: torch.nn.Module) -> dict[str, Any]:
        data = dataset_for(self.spec)
        x = torch.as_tensor(data.x_test)
        y = torch.as_tensor(data.y_test)
        return evaluate(model, x, y, self.spec.model.loss)

    def _assemble(self, model: torch.nn.Module, buffers: list[torch.Tensor]) -> torch.nn.Module:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        params = self.layout.unpack(buffers, shapes)
        extra = {}
        stats = getattr(self, "replica_stats", None)
        if stats and stats[0].get("extra", {}).get("buffers"):
            extra = stats[0]["extra"]["buffers"]
        model.load_state_dict({**model.state_dict(), **params, **extra})
        return model

    def _finish(self, model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
        self.close_data_plane()
        model = self._assemble(model, self.pull_params())
        final_eval = self._eval(model)
        if final_eval:
            self._log({"eval": final_eval}, self.global_step)
        _atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.run_dir / "model.pt")
        return model, final_eval

    def _cancel(self) -> None:
        self.close_data_plane()
        if self.driver is not None:
            self.driver.stop()
        futures = [f for f in self.replica_futures + self.shard_futures if f is not None]
        if futures:
            try:
                self.request_stop()
                self.client.cancel(futures, force=True)
            except Exception as exc:
                logger.debug("cancel failed: %s", exc)

    def _summary(self, status: str, error: str | None, final_eval: dict[str, Any], wall_s: float) -> dict[str, Any]:
        last_loss = next((r["loss"] for r in reversed(self.records) if r.get("loss") is not None), None)
        train_s = getattr(self, "train_s", None) or (time.time() - getattr(self, "t_train", time.time()))
        summary = {
            "name": self.spec.name, "status": status, "global_step": self.global_step,
            "final_loss": last_loss, "eval": final_eval or None, "wall_s": round(wall_s, 3),
            "samples_per_sec": (self.samples / train_s) if train_s > 0 else None,
            "mode": self.spec.training.mode, "replication": self.spec.training.replication,
            "replicas": self.plan.num_replicas, "recoveries": self.recoveries, "dropped_stale": self.dropped_stale,
            "samples": self.samples, "train_s": round(train_s, 3), "pipeline_hash": self.plan.pipeline_hash,
            "ps_tasks": [s.task for s in self.plan.shards], "start_step": self.start_step,
            "recovery_log": self.recovery_log, "checkpoints": self.checkpoints_written,
        }
        if self.spec.training.replication == "between_graph":
            t = self.spec.training
            summary["data_plane"] = {"transport": t.transport, "wire_dtype": t.wire_dtype, **self.data_plane_counts}
        if error:
            summary["error"] = error
        return summary


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    ckpt_io.atomic_write(path, (json.dumps(obj, indent=2, default=str) + "\n").encode("utf-8"))


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    ckpt_io.atomic_write(path, buf.getvalue())
