"""The monitored training session: the chief's loop.

:class:`Session` initialises the variables (seeded) in a :class:`~dtrain.chief.shards.ShardGroup`
(one ParameterShard actor per shard, pinned to its ps task's worker), restores them from the
newest checkpoint on ``--resume``, submits one long-running replica future per worker task
(pinned by address, never stolen), then follows progress by polling ps task 0 a few times a
second (replicas are never slowed by it): summaries, hooks, evaluation, checkpoints due, lost
tasks (handed to :class:`~dtrain.chief.recovery.Recovery`) and the end of the run, and writes the
run directory (docs/cli.md, "Run directory"). The tensor math lives in the ps and worker planes.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from distributed import Future
from distributed import wait as wait_futures

from dtrain.deploy import phases
from dtrain.deploy.cluster import Connection
from dtrain.model.build import build_model
from dtrain.plan.compiler import compile
from dtrain.plan.layout import ShardLayout
from dtrain.spec.errors import RunError, Terminated
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.tasks import replica_task

from . import checkpoint as ckpt_io
from . import data_report, elastic, evaluation, signals, stages, telemetry
from .hooks import Hook, NanGuardHook, StepContext, StopAtStepHook, build_hooks, call_step_hooks, nan_stop
from .inputs import DataInput, with_stats
from .metrics import JsonlSink, TensorBoardSink
from .recovery import Recovery
from .rundir import Result, save_torch, write_cluster_info, write_json
from .saver import Saver
from .shards import ShardGroup, task_host

logger = logging.getLogger(__name__)

POLL_S = 0.1


class Session:
    """One training run on a connected cluster (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, conn: Connection, run_dir: Path, resume: bool = False,
                 progress: Callable[[dict[str, Any]], None] | None = None, hooks: list[Hook] | None = None,
                 data: DataInput | None = None):
        self.spec = spec
        self.conn = conn
        self.client = conn.client
        self.run_dir = run_dir
        self.resume = resume
        self.progress = progress
        self.data_input = data  # a sharded dataset (files or a Dask collection): chief/inputs.py
        self.plan = self.compile_plan()
        if elastic.required_missing(self.spec, self.plan):
            raise RunError("no worker for task(s) " + ", ".join(elastic.required_missing(self.spec, self.plan)))
        self.layout = ShardLayout.from_plan(self.plan)
        self._table_names = {t.name for t in self.plan.tables}  # sparse tables: rows on the ps, not in the layout
        self.token = uuid.uuid4().hex[:8]
        self.hooks: list[Hook] = build_hooks(spec.hooks) if hooks is None else hooks
        self.shards = ShardGroup(conn, spec, self.plan, self.token,
                                 nan_guard=any(isinstance(h, NanGuardHook) for h in self.hooks))
        self.recovery = Recovery(self)
        self.start_step = 0
        self.global_step = 0
        self.dropped_stale = 0
        self.samples = 0
        self.records: list[dict[str, Any]] = []
        self.replica_futures: list[Future | None] = []
        self.stage_futures: dict[int, list[Future]] = {}  # a pipeline's later stages, per replica (chief/stages.py)
        self.replica_stats: list[dict[str, Any]] = []
        self.sinks: list[Any] = []
        self.eval_history: list[dict[str, Any]] = []
        self.driver: Any = None  # in-graph replication's step driver
        self.local_steps: dict[Any, int] = {}
        self._submits = 0
        self.saver = Saver(self)  # checkpoint cadence and saving (chief/saver.py)
        self.summary_written = False
        self.stop_reason: str | None = None  # why training ended before training.steps (a hook, nan_guard)
        self._begun = False
        self.retired: set[int] = set()  # replicas at the end of their data (no sync step waits for them)
        self.elastic = elastic.elastic(self)  # workers that join and leave (chief/elastic.py), or None

    def compile_plan(self) -> Any:
        """The plan on the cluster's workers (with a sharded dataset's assignment and statistics)."""
        if self.data_input is None:
            return compile(self.spec, self.conn.workers(), keep=self.conn.tasks)
        return with_stats(compile(self.spec, self.conn.workers(), data=self.data_input.manifests, keep=self.conn.tasks),
                          self.data_input)

    @property
    def generation(self) -> int:
        return self.shards.generation

    @property
    def run_id(self) -> str:
        """This run's id (``<name>-<token>``, one per start or resume): the scheduler's page, its
        Prometheus series and the replicas' reports tell runs apart by it, never by name alone."""
        return f"{self.spec.name}-{self.token}"

    @property
    def recoveries(self) -> int:
        return self.recovery.count

    # ------------------------------------------------------------------ replicas
    def submit_replicas(self, only: int | None = None) -> None:
        """Submit every replica (or just ``only``), each pinned to its worker task's address."""
        if self.spec.training.replication == "in_graph":
            from .ingraph import new_driver

            self.driver = new_driver(self.client, self.spec, self.plan, self.shards.refs(), self.conn.tasks,
                                     f"{self.token}-g{self.generation}", self.local_steps)
            self.driver.start()
            return
        refs = self.shards.refs()
        if only is None:
            self.replica_futures = [None] * self.plan.num_replicas
        self.retired -= {r.index for r in self.plan.replicas if only is None or r.index == only}
        self._submits += 1
        replicas = [r for r in self.plan.replicas if (only is None or r.index == only) and r.task in self.conn.tasks]
        if self.shards.data_plane:  # fencing: this submission owns these replica indices now
            self.shards.set_owners({r.index: self._submits for r in replicas})
        for r in replicas:
            addr = self.conn.tasks[r.task]
            if r.stage_tasks:
                self.replica_futures[r.index] = stages.submit(self, r, refs, self._start_local_step(r.index), self._submits)
                continue
            self.replica_futures[r.index] = self.client.submit(
                replica_task, self.spec, self.plan, r.index, refs, self._start_local_step(r.index),
                self.shards.data_plane, self._local_rank(r.index), attempt=self._submits, run_id=self.run_id,
                workers=[addr],
                allow_other_workers=False, pure=False,
                key=f"dtrain-replica-{r.index}-g{self.generation}-{self._submits}-{self.token}")

    def _local_rank(self, index: int) -> int:
        """Replica ``index``'s rank among the replicas whose workers share its machine (by address
        host), for ``training.pin_cpus``."""
        def host(task: str) -> str:
            return task_host(self.conn.tasks[task])

        mine = host(self.plan.replicas[index].task)
        return [r.index for r in self.plan.replicas if r.task in self.conn.tasks and host(r.task) == mine].index(index)

    def _start_local_step(self, index: int) -> int:
        """Where replica ``index`` resumes in its data order: in sync mode without backups every
        replica contributes once per step, so its local step is the global step; otherwise the last
        local step it reported to ps task 0."""
        if self.plan.lockstep:
            step = self._ps_step()
        else:
            step = int(self.local_steps.get(index, self.local_steps.get(str(index), 0)))
        total = data_report.total_batches(self.spec, self.plan, index)
        return step if total is None else min(step, total)  # a replica retired at the end of its data

    def _ps_step(self) -> int:
        """The ps's own step (the polled ``global_step`` may lag it by ~0.1 s of steps)."""
        try:
            return max(self.shards.steps(timeout=10))
        except Exception:  # a lost shard: what was seen last
            return self.global_step

    def _replica_failure(self) -> str | None:
        if self.driver is not None:
            return self.driver.error()
        for r, fut in zip(self.plan.replicas, self.replica_futures, strict=True):
            if fut is None:  # a free elastic slot
                continue
            if fut.status == "error":
                exc = fut.exception(timeout=5)
                return f"replica {r.index} on {r.task} failed: {type(exc).__name__}: {exc}"
            if fut.status == "cancelled":
                return f"replica {r.index} on {r.task} was cancelled (its worker was lost?)"
        return stages.failure(self)

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        status, error = "failed", None
        model = None
        final_eval: dict[str, Any] = {}
        try:
            self._open_sinks()
            telemetry.start(self)  # (and prints the dashboard's address)
            torch.manual_seed(self.spec.training.seed)
            init_model = build_model(self.spec, gathered_tables=True)  # tables: initialised on the ps
            self.init_buffers = self.layout.pack(dict(init_model.named_parameters()))
            # --resume: the newest valid checkpoint; an unreadable one, or checkpoints none of which
            # is valid, is an error (CheckpointError), never a silent restart from step 0.
            latest = ckpt_io.latest(self.run_dir) if self.resume else None
            if self.resume and latest is None:
                logger.warning("--resume: no checkpoint in %s; starting from step 0", self.run_dir)
            self.start_generation(latest)
            phases.mark("ps actors created, replicas submitted")
            stops = [h.last_step for h in self.hooks if isinstance(h, StopAtStepHook) and h.last_step is not None]
            if stops:  # a stop_at_step hook ends training exactly there, as training.steps does
                self.shards.stop_at(min(stops))
            self.t_train = time.time()
            self._monitor()
            phases.mark("training, to the last step")
            self.train_s = time.time() - self.t_train
            if self.spec.checkpoint is not None and self.saver.last_step != self.global_step:
                self.saver.save()
            model, final_eval = self._finish(init_model)
            phases.mark("final evaluation, model.pt")
            status = "completed"
        except KeyboardInterrupt as exc:
            status, error = "interrupted", str(exc) if isinstance(exc, Terminated) and str(exc) else (
                "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted")
            with signals.deferred():
                # First what a kill during the cleanup would otherwise lose: a provisional summary,
                # then a checkpoint with every shard held and stopped at one step.
                self._write_summary(status, error, {}, time.time() - t_start)
                if self.spec.checkpoint is not None and self.shards.handles:
                    try:
                        self.saver.save(stop=True)
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
            self.shards.stop_renewing()
            with signals.deferred():
                if status != "completed":
                    self.saver.commit_pending()
                    self._write_summary(status, error, final_eval, time.time() - t_start)  # provisional
                    self._cancel()
                for h in self.hooks:
                    try:
                        h.end(self)
                    except Exception as exc:  # a hook's failure must not hide the run's own outcome
                        logger.warning("hook %s failed at end: %s", type(h).__name__, exc)
                summary = self._write_summary(status, error, final_eval, time.time() - t_start)
                telemetry.close(self)
                for sink in self.sinks:
                    sink.close()
        return Result(summary=summary, model=model, run_dir=self.run_dir, plan=self.plan,
                      replica_stats=list(self.replica_stats))

    def _write_summary(self, status: str, error: str | None, final_eval: dict[str, Any], wall_s: float
                       ) -> dict[str, Any]:
        """Write summary.json; a failure to write (a full disk) is logged, never raised over the
        run's own outcome and exit code."""
        summary = self._summary(status, error, final_eval, wall_s)
        try:
            write_json(self.run_dir / "summary.json", summary)
            self.summary_written = True
        except OSError as exc:
            logger.error("could not write %s: %s", self.run_dir / "summary.json", exc)
        return summary

    def write_cluster_info(self, refresh: bool = True) -> None:
        write_cluster_info(self.run_dir, self.conn, self.generation, self.plan.assignment, refresh)

    def start_generation(self, checkpoint: ckpt_io.Checkpoint | None) -> None:
        """Create the ps actors (restored from ``checkpoint`` when given) and start the replicas."""
        self.write_cluster_info()
        self.saver.abandon()  # (a checkpoint the previous generation's shards were writing)
        self.shards.create(self.init_buffers)
        if checkpoint is not None:
            checkpoint = self.saver.restore(checkpoint)
            self.global_step = checkpoint.step
            self.saver.restored(checkpoint.step)
            self.local_steps = {int(k): v for k, v in checkpoint.payload.get("replicas", {})
                                .get("local_steps", {}).items()}
            logger.info("restored %s (global step %d)", checkpoint.path.name, checkpoint.step)
        if not self._begun:  # the hooks' begin(): once, with the ps initialised, before replicas start
            self._begun, self.start_step = True, self.global_step
            for h in self.hooks:
                h.begin(self)
        if checkpoint is None and self.spec.checkpoint is not None:  # TF's saver: a checkpoint at creation
            self.saver.save()
        if self.elastic is not None:
            self.elastic.retire_free()
        self.submit_replicas()

    def _open_sinks(self) -> None:
        if not self.resume:
            # A fresh run in a directory an earlier run (without checkpoints) used: its metrics.jsonl
            # is replaced, so are its TensorBoard events (mixed, they would draw both runs as one
            # curve) and its model.pt (it is not this run's).
            shutil.rmtree(self.run_dir / "tb", ignore_errors=True)
            (self.run_dir / "model.pt").unlink(missing_ok=True)
        self.sinks = [JsonlSink(self.run_dir / "metrics.jsonl", append=self.resume)]
        if self.spec.summary.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tb"))

    def _log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def _monitor(self) -> None:
        stopping = False
        last_step = -1
        lr = getattr(self.spec.optimizer, "lr", None)
        latest: dict[str, Any] = {"learning_rate": lr}  # known before the first summary record
        last_liveness = 0.0
        while True:
            now = time.monotonic()
            if now - last_liveness >= 0.25:
                last_liveness = now
                if self.recovery.check() or (self.elastic is not None and self.elastic.poll()):
                    continue
            try:
                stats = self.shards.stats(timeout=10)
            except Exception as exc:
                if not (self.recovery.recover_if_lost(exc) or self.recovery.recover_if_transient(exc)):
                    raise RunError(f"ps task 0 does not answer: {type(exc).__name__}: {exc}") from None
                continue
            if stats["generation"] != self.generation:
                continue
            self.global_step = stats["step"]
            self.dropped_stale = stats["dropped_stale"]
            self.samples = stats["samples"]
            self.local_steps.update({int(k): v for k, v in stats["local_steps"].items()})
            log = self.recovery.log
            if log and "first_apply_s" not in log[-1] and stats["last_apply_time"] > log[-1]["time"]:
                rec = log[-1]
                rec["first_apply_s"] = stats["last_apply_time"] - rec["time"]
                logger.warning("recovered: first update %.1f s after the loss was seen", rec["first_apply_s"])
            # A checkpoint due is started before an evaluation of the same step: the shards are held
            # for its snapshot only, never for the evaluation (its parts are written in the background).
            if self.saver.due():
                self.recovery.guarded(self.saver.save, False, False)
            elif self.saver.pending is not None:
                self.recovery.guarded(self.saver.poll)
            for rec in stats["records"]:
                metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
                metrics["learning_rate"], metrics["replicas"] = lr, elastic.live_count(self)
                telemetry.attach(self, metrics, rec["step"])
                self._log(metrics, rec["step"])
                self.records.append(rec)
                latest = metrics
                every = self.spec.eval.every_steps
                if every and rec["step"] % every == 0 and rec["step"] < self.shards.last_step:
                    self.recovery.guarded(evaluation.evaluate_now, self, rec["step"])
            if self.global_step != last_step:
                ctx = StepContext(self.global_step, dict(latest), write=self._log)
                try:
                    call_step_hooks(self.hooks, ctx)
                except Exception as exc:  # TF's Aborted/Unavailable from a hook: recover; others fail
                    if self.recovery.recover_if_transient(exc):
                        continue
                    raise
                if ctx.stop_requested and not stopping:
                    logger.info("stopping: %s", ctx.stop_requested)
                    stopping, self.stop_reason = True, ctx.stop_requested
                    self.recovery.guarded(self.shards.stop_consistently)
                last_step = self.global_step
            self._report_progress(latest)
            if stats["error"] and not self._nan_stop(stats["error"]):
                self.shards.request_stop()
                raise RunError(stats["error"])
            failure = self._replica_failure()
            if failure:  # a lost stage's neighbours fail before the scheduler sees its worker gone: wait
                if self.recovery.recover_if_lost(RuntimeError(failure), wait_s=5.0 if self.plan.stages else 0.0) \
                        or self.recovery.recover_if_transient(self.recovery.replica_error()):
                    continue
                self.saver.before_failing(failure)
                self.shards.request_stop()
                raise RunError(failure)
            data_report.retire_finished(self)
            if self.driver is not None:
                if self.driver.done():
                    break
            elif any(self.replica_futures) and all(f.status == "finished" for f in self.replica_futures if f):
                break
            time.sleep(POLL_S)
        if self.driver is not None:
            self.replica_stats = self.driver.replica_stats()
        else:
            self.replica_stats = [f.result() if f is not None else {} for f in self.replica_futures]
            stages.collect(self, self.replica_stats)
        for r, st in zip(self.plan.replicas, self.replica_stats, strict=True):
            if "GPU" in r.device and not str(st.get("device", "")).startswith("cuda"):
                logger.warning("replica %d was placed on %s but computed on %s (placement.soft: no CUDA device "
                               "on %s)", r.index, r.device, st.get("device"), r.task)
        final = self.shards.stats(timeout=30)
        self.global_step, self.dropped_stale, self.samples = final["step"], final["dropped_stale"], final["samples"]
        for rec in final["records"]:
            metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
            latest = {**latest, **metrics}
            self._log(metrics, rec["step"])
            self.records.append(rec)
        self._report_progress(latest)  # the last step, which the replicas may reach after the last poll
        if final["error"] and not self._nan_stop(final["error"]):  # nan_guard fired after the last poll
            raise RunError(final["error"])

    def _report_progress(self, latest: dict[str, Any]) -> None:
        """The ``progress`` callback's record (the CLI's progress line; docs/observability.md)."""
        if self.progress is not None:
            self.progress({"step": self.global_step, "steps": self.shards.last_step,
                           "loss": latest.get("loss"), "samples_per_sec": latest.get("samples_per_sec"),
                           "dropped_stale": self.dropped_stale, "replicas": elastic.live_count(self),
                           "replicas_max": self.plan.num_replicas, "elastic": self.elastic is not None,
                           **data_report.progress(self)})

    def _nan_stop(self, error: str) -> bool:
        """A nan_guard hook with ``mode: warn`` turns the ps's refusal into a clean stop (TF's
        NanTensorHook(fail_on_nan_loss=False)): the parameters are the last good ones."""
        if not nan_stop(self.hooks, error):
            return False
        if self.stop_reason != error:
            logger.warning("%s; stopping (nan_guard mode: warn)", error)
            self.stop_reason = error
            self.shards.request_stop()
        return True

    def _finish(self, model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
        self.shards.close_data_plane()
        whole = evaluation.tables_fit_model_pt(self.plan)
        if not whole:
            logger.warning("model.pt holds the dense parameters only: the tables' rows (more than %d MiB) stay in the "
                           "checkpoints", evaluation.MODEL_PT_TABLE_BYTES >> 20)
        model = evaluation.assemble(self, model, self.shards.pull_params(for_eval=True), with_tables=whole)
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # a run that diverged never ends "completed", with or without a nan_guard hook
            raise RunError(f"the parameters became non-finite (NaN or inf) by step {self.global_step}: "
                           f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; model.pt not written (lower "
                           "optimizer.lr, check the data, or add a nan_guard hook to stop at the first one)")
        final_eval = evaluation.evaluate(self, model)
        if final_eval:
            self._log({"eval": final_eval}, self.global_step)
        save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.run_dir / "model.pt")
        return model, final_eval

    def _cancel(self, grace_s: float = 3.0) -> None:
        """End a run that did not complete. The order matters: replicas are first asked to stop
        (each sees it in its next reply and returns), given ``grace_s`` to do so, and only then is
        the data plane closed and what is left cancelled. Closing the data plane under a running
        replica fails its task, and its worker prints Dask's "Compute Failed" with a traceback."""
        if self.driver is not None:
            self.driver.stop()
        futures = [f for f in self.replica_futures + stages.futures_of(self) + self.shards.futures if f is not None]
        replicas = [f for f in self.replica_futures + stages.futures_of(self) if f is not None and not f.done()]
        if futures:
            self.shards.request_stop()
        if replicas:
            with contextlib.suppress(Exception):  # a replica blocked on a lost ps: cancelled below
                wait_futures(replicas, timeout=grace_s)
        self.shards.close_data_plane()
        if futures:
            try:
                self.client.cancel(futures, force=True)
            except Exception as exc:
                logger.debug("cancel failed: %s", exc)

    def _summary(self, status: str, error: str | None, final_eval: dict[str, Any], wall_s: float) -> dict[str, Any]:
        last_loss = next((r["loss"] for r in reversed(self.records) if r.get("loss") is not None), None)
        train_s = getattr(self, "train_s", None) or (time.time() - getattr(self, "t_train", time.time()))
        # The chief's step comes from its last poll; a checkpoint written since (before failing, on
        # an interrupt) holds the ps's own, newer step: a summary never names a step older than it.
        step = max(self.global_step, self.saver.last_step or 0)
        summary = {
            "name": self.spec.name, "run_id": self.run_id, "status": status, "global_step": step,
            "final_loss": last_loss, "eval": final_eval or None, "wall_s": round(wall_s, 3),
            "samples_per_sec": (self.samples / train_s) if train_s > 0 else None,
            "mode": self.spec.training.mode, "replication": self.spec.training.replication,
            "replicas": self.plan.num_replicas, "recoveries": self.recoveries, "dropped_stale": self.dropped_stale,
            "samples": self.samples, "train_s": round(train_s, 3), "pipeline_hash": self.plan.pipeline_hash,
            "ps_tasks": [s.task for s in self.plan.shards], "start_step": self.start_step,
            "recovery_log": self.recovery.log, "checkpoints": self.saver.written,
            "checkpoint_waits": self.saver.waited, "checkpoint_deltas": self.saver.kinds.count("delta"),
            "checkpoint_stall_s": round(sum(self.saver.stalls) + self.saver.wait_s, 3),
        }
        if self.spec.training.replication == "between_graph":
            t = self.spec.training
            summary["data_plane"] = {"transport": t.transport, "wire_dtype": t.wire_dtype,
                                     **self.shards.data_plane_counts}
        if self.plan.tables:
            try:  # (a run whose ps tasks are gone has no figures to give)
                summary["tables"] = self.shards.table_stats()
            except Exception as exc:
                logger.debug("no table figures: %s", exc)
        summary.update(data_report.summary(self))
        summary.update(elastic.summary(self))
        summary.update(telemetry.summary(self))
        if error:
            summary["error"] = error
        if self.stop_reason:
            summary["stop_reason"] = self.stop_reason
        return summary
