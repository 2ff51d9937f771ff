"""The monitored training session: the chief's loop.

:class:`Session` initialises the variables (seeded) in a :class:`~dtrain.chief.ps_shards.ShardGroup`
(one ParameterShard actor per shard, pinned to its ps task's worker), restores them from the
newest checkpoint on ``--resume``, submits one long-running replica future per worker task
(pinned by address, never stolen), then follows progress by polling ps task 0 a few times a
second (replicas are never slowed by it): summaries, hooks, evaluation, checkpoints due, lost
tasks (handed to :class:`~dtrain.chief.recovery.Recovery`) and the end of the run, and writes the
run directory (docs/cli.md, "Run directory"). The tensor math lives in the ps and worker planes.

The session is built from named roles (docs/architecture.md, "The chief"): the run's fixed
:class:`~dtrain.chief.context.RunContext` and its declared :class:`~dtrain.chief.context.RunState`,
the :class:`~dtrain.chief.ps_shards.ShardGroup`, the :class:`~dtrain.chief.replicas.ReplicaSet`, the
:class:`~dtrain.chief.saver.Saver`, the :class:`~dtrain.chief.evaluation.Evaluator`, and two deciders,
:class:`~dtrain.chief.recovery.Recovery` and :class:`~dtrain.chief.elastic.Elastic`, whose decisions
(restart from a checkpoint, resubmit replicas, re-form the replica set) only the session carries
out. Each role receives what it needs by name, never the session; only the session rebinds the
run state's fields.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtrain.deploy import phases
from dtrain.deploy.cluster import Connection
from dtrain.errors import RunError, Terminated
from dtrain.model.build import build_model
from dtrain.plan.compiler import Plan
from dtrain.plan.compiler import compile as compile_plan
from dtrain.plan.layout import ShardLayout
from dtrain.spec.pipeline import PipelineSpec

from . import checkpoint as ckpt_io
from . import data_report, elastic, evaluation, signals, telemetry
from .context import RunContext, RunState, run_plan
from .elastic import FENCED, Reform
from .hooks import (
    Hook,
    NanGuardHook,
    RunView,
    StepContext,
    StopAtStepHook,
    build_hooks,
    call_step_hooks,
    nan_stop,
)
from .inputs import DataInput
from .metrics import JsonlSink, TensorBoardSink
from .ps_shards import ShardGroup
from .recovery import Decision, Loss, Recovery, Restart
from .replicas import ReplicaSet
from .rundir import Result, save_torch, write_cluster_info, write_json
from .saver import Saver

logger = logging.getLogger(__name__)

POLL_S = 0.1


class Session:
    """One training run on a connected cluster (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, conn: Connection, run_dir: Path, resume: bool = False,
                 progress: Callable[[dict[str, Any]], None] | None = None, hooks: list[Hook] | None = None,
                 data: DataInput | None = None, plan: Plan | None = None):
        # ``plan``: the spec's plan, compiled (dtrain.run's pre-flight compiles it); compiled here
        # otherwise. Either way the only compile of the run: it is bound to the workers (place_plan).
        compiled = plan if plan is not None else compile_plan(spec)
        self.ctx = RunContext(spec, conn, run_dir, token=uuid.uuid4().hex[:8], resume=resume, data_input=data,
                              progress=progress, compiled=run_plan(compiled, data))
        plan = self.ctx.place_plan()
        if elastic.required_missing(spec, plan):
            raise RunError("no worker for task(s) " + ", ".join(elastic.required_missing(spec, plan)))
        self.state = RunState(plan)
        self.hooks: list[Hook] = build_hooks(spec.hooks) if hooks is None else hooks
        self.shards = ShardGroup(conn, spec, plan, self.ctx.token,
                                 nan_guard=any(isinstance(h, NanGuardHook) for h in self.hooks))
        self.replicas = ReplicaSet(self.ctx, self.state, self.shards)
        self.saver = Saver(self.ctx, self.state, self.shards, self.hooks)  # checkpoint cadence and saving
        self.evaluator = evaluation.Evaluator(self.ctx, self.state, self.shards, self._log)
        self.elastic = elastic.elastic(self.ctx, self.state, self.replicas)  # workers that join and leave, or None
        self.recovery = Recovery(self.ctx, self.state, self.shards, self.replicas, self.saver, self.hooks,
                                 elastic=self.elastic is not None)
        self.sinks: list[Any] = []  # metrics.jsonl and TensorBoard, opened by run()
        self.telemetry: telemetry.Telemetry | None = None  # started by run()

    # ------------------------------------------------------------------ read-only views
    @property
    def spec(self) -> PipelineSpec:
        return self.ctx.spec

    @property
    def run_dir(self) -> Path:
        return self.ctx.run_dir

    @property
    def run_id(self) -> str:
        """This run's id (``<name>-<token>``): :attr:`RunContext.run_id`."""
        return self.ctx.run_id

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def start_step(self) -> int:
        return self.state.start_step

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.state.records

    @property
    def replica_stats(self) -> list[dict[str, Any]]:
        return self.state.replica_stats

    @property
    def summary_written(self) -> bool:
        return self.state.summary_written

    @property
    def generation(self) -> int:
        return self.shards.generation

    @property
    def recoveries(self) -> int:
        return self.recovery.count

    # ------------------------------------------------------------------ carrying out decisions
    def _replan(self, refresh: bool = True) -> None:
        """The plan on the cluster's workers now (after a recovery or a join), and the run
        directory's cluster.json with it."""
        self.state.plan = self.shards.plan = self.ctx.place_plan()
        self._write_cluster_info(refresh)

    def _recover(self, loss: Loss | None) -> bool:
        """Carry out the recovery from ``loss`` (None: nothing to recover; says whether there was);
        a task lost again while doing so, or a transient error then, is a further recovery
        (:meth:`Recovery.again`)."""
        if loss is None:
            return False
        while True:
            try:
                self._carry_out(self.recovery.decide(loss))
                return True
            except RunError:
                raise
            except Exception as exc:
                again = self.recovery.again(exc)
                if again is None:
                    raise
                loss = again

    def _carry_out(self, decision: Decision) -> None:
        if isinstance(decision, Restart):
            self.shards.generation += 1
            if decision.checkpoint is None:  # the initial parameters, at step 0
                self.state.global_step = 0
                self.state.local_steps = {}
            self.state.plan = self.shards.plan = self.ctx.place_plan()
            self.start_generation(decision.checkpoint)
        else:
            self._replan()
            for i in decision.replicas:
                self.replicas.submit(only=i)
        self.recovery.recovered(decision)

    def _reform(self, reform: Reform | None) -> bool:
        """Carry out the elastic replica set's ``reform`` (None: no change; says whether there was)."""
        if reform is None or self.elastic is None:
            return False
        sync = self.spec.training.mode == "sync"
        for slot in reform.leaves:
            released = self.replicas.leave(slot.index)  # (its work done: an idle worker retired)
            del self.ctx.conn.tasks[slot.task]
            if not released:
                # Fence it off (either transport): its next push is refused and its task ends.
                self.shards.set_owners({slot.index: FENCED})
                if sync:  # no step waits for it: the quorum follows the live replicas
                    self.shards.retire([slot.index])
            self.elastic.left_slot(slot, released)
        for slot in reform.joins:
            self.ctx.conn.tasks[slot.task] = slot.address
        self._replan(refresh=False)
        if reform.joins and sync:
            # Every shard takes the newcomers into its quorum at one step (held there: with several
            # ps tasks a step completed on one between two calls would wait forever for a newcomer
            # that starts behind it), and the live replicas may wait for their first push as long
            # as a replica's start may take.
            self.shards.hold_consistent()
            try:
                self.shards.retire([s.index for s in reform.joins], how="rejoin")
            finally:
                self.shards.release()
            self.shards.grant_barrier_grace(self.spec.training.call_timeout_s)
        for slot in reform.joins:
            self.replicas.submit(only=slot.index)
            self.elastic.joined_slot(slot)
        return True

    def _view(self) -> RunView:
        """What the hooks' begin() and end() see of the run (read-only; the hook API)."""
        return RunView(self.ctx, self.state, write=self._log, stop=self._request_stop)

    def _request_stop(self, reason: str) -> None:
        """A hook's ``run.request_stop()`` outside a step: acted on at the next step observed."""
        self.state.stop_requested = self.state.stop_requested or reason

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a coordinator action that calls the ps; a lost task or a transient error turns into a
        recovery."""
        try:
            return fn(*args)
        except RunError:
            raise
        except Exception as exc:
            if not self._recover(self.recovery.after_error(exc)):
                raise
            return None

    # ------------------------------------------------------------------ the run
    def run(self) -> Result:
        ctx, state = self.ctx, self.state
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        t_start = time.time()
        status, error = "failed", None
        model = None
        final_eval: dict[str, Any] = {}
        try:
            self._open_sinks()
            # (and prints the dashboard's address)
            self.telemetry = telemetry.start(ctx, state, self.shards, self.saver, self.recovery)
            torch.manual_seed(ctx.spec.training.seed)
            init_model = build_model(ctx.spec, gathered_tables=True)  # tables: initialised on the ps
            state.init_buffers = ShardLayout.from_plan(state.plan).pack(dict(init_model.named_parameters()))
            # --resume: the newest valid checkpoint; an unreadable one, or checkpoints none of which
            # is valid, is an error (CheckpointError), never a silent restart from step 0.
            latest = ckpt_io.latest(ctx.run_dir) if ctx.resume else None
            if ctx.resume and latest is None:
                logger.warning("--resume: no checkpoint in %s; starting from step 0", ctx.run_dir)
            self.start_generation(latest)
            phases.mark("ps actors created, replicas submitted")
            stops = [h.last_step for h in self.hooks if isinstance(h, StopAtStepHook) and h.last_step is not None]
            if stops:  # a stop_at_step hook ends training exactly there, as training.steps does
                self.shards.stop_at(min(stops))
            state.t_train = time.time()
            self._monitor()
            phases.mark("training, to the last step")
            state.train_s = time.time() - state.t_train
            if ctx.spec.checkpoint is not None and self.saver.last_step != state.global_step:
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
                if ctx.spec.checkpoint is not None and self.shards.handles:
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
                    self.replicas.cancel()
                view = self._view()
                for h in self.hooks:
                    try:
                        h.end(view)
                    except Exception as exc:  # a hook's failure must not hide the run's own outcome
                        logger.warning("hook %s failed at end: %s", type(h).__name__, exc)
                summary = self._write_summary(status, error, final_eval, time.time() - t_start)
                telemetry.close(self.telemetry)
                for sink in self.sinks:
                    sink.close()
        return Result(summary=summary, model=model, run_dir=ctx.run_dir, plan=state.plan,
                      replica_stats=list(state.replica_stats))

    def _write_summary(self, status: str, error: str | None, final_eval: dict[str, Any], wall_s: float
                       ) -> dict[str, Any]:
        """Write summary.json; a failure to write (a full disk) is logged, never raised over the
        run's own outcome and exit code."""
        summary = self._summary(status, error, final_eval, wall_s)
        try:
            write_json(self.ctx.run_dir / "summary.json", summary)
            self.state.summary_written = True
        except OSError as exc:
            logger.error("could not write %s: %s", self.run_dir / "summary.json", exc)
        return summary

    def _write_cluster_info(self, refresh: bool = True) -> None:
        write_cluster_info(self.ctx.run_dir, self.ctx.conn, self.generation, self.state.plan.assignment, refresh)

    def start_generation(self, checkpoint: ckpt_io.Checkpoint | None) -> None:
        """Create the ps actors (restored from ``checkpoint`` when given) and start the replicas."""
        state = self.state
        self._write_cluster_info()
        self.saver.abandon()  # (a checkpoint the previous generation's shards were writing)
        self.shards.create(state.init_buffers)
        if checkpoint is not None:
            checkpoint = self.saver.restore(checkpoint)
            # A sharded dataset's positions index the files, batch and window they were written
            # under: another layout would silently repeat or skip samples.
            why = data_report.layout_change(checkpoint.payload.get("replicas", {}).get("data_layout"),
                                            data_report.data_layout(self.spec, state.plan))
            if why:
                raise RunError(f"cannot resume from {checkpoint.path.name}: {why}, so its replicas' positions would "
                               "repeat or skip samples; restore the data and data settings it was written with, or "
                               "start over in another --run-dir")
            state.global_step = checkpoint.step
            self.saver.restored(checkpoint.step)
            state.local_steps = {int(k): v for k, v in checkpoint.payload.get("replicas", {})
                                 .get("local_steps", {}).items()}
            logger.info("restored %s (global step %d)", checkpoint.path.name, checkpoint.step)
        if not state.begun:  # the hooks' begin(): once, with the ps initialised, before replicas start
            state.begun, state.start_step = True, state.global_step
            view = self._view()
            for h in self.hooks:
                h.begin(view)
        if checkpoint is None and self.spec.checkpoint is not None:  # TF's saver: a checkpoint at creation
            self.saver.save()
        # Sync: the shards (new, or restored) wait for no free elastic slot's replica.
        if self.elastic is not None and self.spec.training.mode == "sync" and (free := self.elastic.free()):
            self.shards.retire(free)
        self.replicas.submit()

    def _open_sinks(self) -> None:
        run_dir = self.ctx.run_dir
        if not self.ctx.resume:
            # A fresh run in a directory an earlier run (without checkpoints) used: its metrics.jsonl
            # is replaced, so are its TensorBoard events (mixed, they would draw both runs as one
            # curve) and its model.pt (it is not this run's).
            shutil.rmtree(run_dir / "tb", ignore_errors=True)
            (run_dir / "model.pt").unlink(missing_ok=True)
        self.sinks = [JsonlSink(run_dir / "metrics.jsonl", append=self.ctx.resume)]
        if self.spec.summary.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tb"))

    def _log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def _monitor(self) -> None:
        state, shards, recovery = self.state, self.shards, self.recovery
        stopping = False
        last_step = -1
        lr = getattr(self.spec.optimizer, "lr", None)
        latest: dict[str, Any] = {"learning_rate": lr}  # known before the first summary record
        last_liveness = 0.0
        while True:
            signals.reraise_lost()  # (a signal whose exception a finaliser dropped)
            now = time.monotonic()
            if now - last_liveness >= 0.25:
                last_liveness = now
                if self._recover(recovery.check()) or (self.elastic is not None and self._reform(self.elastic.poll())):
                    continue
            try:
                stats = shards.stats(timeout=10)
            except Exception as exc:
                if not self._recover(recovery.after_error(exc)):
                    raise RunError(f"ps task 0 does not answer: {type(exc).__name__}: {exc}") from None
                continue
            if stats["generation"] != self.generation:
                continue
            state.global_step = stats["step"]
            state.dropped_stale = stats["dropped_stale"]
            state.samples = stats["samples"]
            state.local_steps.update({int(k): v for k, v in stats["local_steps"].items()})
            log = recovery.log
            if log and "first_apply_s" not in log[-1] and stats["last_apply_time"] > log[-1]["time"]:
                rec = log[-1]
                rec["first_apply_s"] = stats["last_apply_time"] - rec["time"]
                logger.warning("recovered: first update %.1f s after the loss was seen", rec["first_apply_s"])
            # A checkpoint due is started before an evaluation of the same step: the shards are held
            # for its snapshot only, never for the evaluation (its parts are written in the background).
            if self.saver.due():
                self._guarded(self.saver.save, False, False)
            elif self.saver.pending is not None:
                self._guarded(self.saver.poll)
            for rec in stats["records"]:
                metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
                metrics["learning_rate"], metrics["replicas"] = lr, elastic.live_count(self.elastic, state.plan)
                telemetry.attach(self.telemetry, metrics, rec["step"])
                self._log(metrics, rec["step"])
                state.records.append(rec)
                latest = metrics
                every = self.spec.eval.every_steps
                if every and rec["step"] % every == 0 and rec["step"] < shards.last_step:
                    self._guarded(self.evaluator.now, rec["step"])
            if state.global_step != last_step:
                ctx = StepContext(state.global_step, dict(latest), write=self._log)
                try:
                    call_step_hooks(self.hooks, ctx)
                except Exception as exc:  # TF's Aborted/Unavailable from a hook: recover; others fail
                    if self._recover(recovery.transient(exc)):
                        continue
                    raise
                reason = ctx.stop_requested or state.stop_requested
                if reason and not stopping:
                    logger.info("stopping: %s", reason)
                    stopping, state.stop_reason = True, reason
                    self._guarded(shards.stop_consistently)
                last_step = state.global_step
            self._report_progress(latest)
            if stats["error"] and not self._nan_stop(stats["error"]):
                shards.request_stop()
                raise RunError(stats["error"])
            failure = self.replicas.failure()
            if failure:  # a lost stage's neighbours fail before the scheduler sees its worker gone: wait
                if self._recover(recovery.lost_after(RuntimeError(failure), wait_s=5.0 if state.plan.stages else 0.0)
                                 or recovery.transient(self.replicas.first_error())):
                    continue
                self.saver.before_failing(failure)
                shards.request_stop()
                raise RunError(failure)
            if done := self.replicas.finished():  # at the end of their data: no sync step waits for them
                state.retired.update(done)
                shards.retire(done)
            if self.replicas.done():
                break
            time.sleep(POLL_S)
        state.replica_stats = self.replicas.results()
        for r, st in zip(state.plan.replicas, state.replica_stats, strict=True):
            if "GPU" in r.device and not str(st.get("device", "")).startswith("cuda"):
                logger.warning("replica %d was placed on %s but computed on %s (placement.soft: no CUDA device "
                               "on %s)", r.index, r.device, st.get("device"), r.task)
        final = shards.stats(timeout=30)
        state.global_step, state.dropped_stale, state.samples = final["step"], final["dropped_stale"], final["samples"]
        for rec in final["records"]:
            metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
            latest = {**latest, **metrics}
            self._log(metrics, rec["step"])
            state.records.append(rec)
        self._report_progress(latest)  # the last step, which the replicas may reach after the last poll
        if final["error"] and not self._nan_stop(final["error"]):  # nan_guard fired after the last poll
            raise RunError(final["error"])

    def _report_progress(self, latest: dict[str, Any]) -> None:
        """The ``progress`` callback's record (the CLI's progress line; docs/observability.md)."""
        state = self.state
        if self.ctx.progress is not None:
            self.ctx.progress({"step": state.global_step, "steps": self.shards.last_step,
                               "loss": latest.get("loss"), "samples_per_sec": latest.get("samples_per_sec"),
                               "dropped_stale": state.dropped_stale,
                               "replicas": elastic.live_count(self.elastic, state.plan),
                               "replicas_max": state.plan.num_replicas, "elastic": self.elastic is not None,
                               **data_report.progress(self.spec, state)})

    def _nan_stop(self, error: str) -> bool:
        """A nan_guard hook with ``mode: warn`` turns the ps's refusal into a clean stop (TF's
        NanTensorHook(fail_on_nan_loss=False)): the parameters are the last good ones."""
        if not nan_stop(self.hooks, error):
            return False
        if self.state.stop_reason != error:
            logger.warning("%s; stopping (nan_guard mode: warn)", error)
            self.state.stop_reason = error
            self.shards.request_stop()
        return True

    def _finish(self, model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
        self.shards.close_data_plane()
        plan = self.state.plan
        whole = evaluation.tables_fit_model_pt(plan)
        if not whole:
            logger.warning("model.pt holds the dense parameters only: the tables' rows (more than %d MiB) stay in the "
                           "checkpoints; the model with its tables is their export: dtrain export %s OUT",
                           evaluation.MODEL_PT_TABLE_BYTES >> 20, self.ctx.run_dir)
        model = self.evaluator.assemble(model, self.shards.pull_params(for_eval=True), with_tables=whole)
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # a run that diverged never ends "completed", with or without a nan_guard hook
            raise RunError(f"the parameters became non-finite (NaN or inf) by step {self.state.global_step}: "
                           f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; model.pt not written (lower "
                           "optimizer.lr, check the data, or add a nan_guard hook to stop at the first one)")
        final_eval = self.evaluator.evaluate(model)
        if final_eval:
            self._log({"eval": final_eval}, self.state.global_step)
        save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.ctx.run_dir / "model.pt")
        return model, final_eval

    def _summary(self, status: str, error: str | None, final_eval: dict[str, Any], wall_s: float) -> dict[str, Any]:
        spec, state, plan, saver = self.spec, self.state, self.state.plan, self.saver
        last_loss = next((r["loss"] for r in reversed(state.records) if r.get("loss") is not None), None)
        train_s = state.train_s or (time.time() - (state.t_train if state.t_train is not None else time.time()))
        # The chief's step comes from its last poll; a checkpoint written since (before failing, on
        # an interrupt) holds the ps's own, newer step: a summary never names a step older than it.
        step = max(state.global_step, saver.last_step or 0)
        summary = {
            "name": spec.name, "run_id": self.ctx.run_id, "status": status, "global_step": step,
            "final_loss": last_loss, "eval": final_eval or None, "wall_s": round(wall_s, 3),
            "samples_per_sec": (state.samples / train_s) if train_s > 0 else None,
            "mode": spec.training.mode, "replication": spec.training.replication,
            "replicas": plan.num_replicas, "recoveries": self.recoveries, "dropped_stale": state.dropped_stale,
            "samples": state.samples, "train_s": round(train_s, 3), "pipeline_hash": plan.pipeline_hash,
            "ps_tasks": [s.task for s in plan.shards], "start_step": state.start_step,
            "recovery_log": self.recovery.log, "checkpoints": saver.written,
            "checkpoint_waits": saver.waited, "checkpoint_deltas": saver.kinds.count("delta"),
            "checkpoint_stall_s": round(sum(saver.stalls) + saver.wait_s, 3),
        }
        if spec.training.replication == "between_graph":
            t = spec.training
            summary["data_plane"] = {"transport": t.transport, "wire_dtype": t.wire_dtype,
                                     **self.shards.data_plane_counts}
        if plan.tables:
            try:  # (a run whose ps tasks are gone has no figures to give)
                summary["tables"] = self.shards.table_stats()
            except Exception as exc:
                logger.debug("no table figures: %s", exc)
        summary.update(data_report.summary(spec, state))
        summary.update(elastic.summary(self.elastic, plan))
        summary.update(telemetry.summary(self.telemetry))
        if error:
            summary["error"] = error
        if state.stop_reason:
            summary["stop_reason"] = state.stop_reason
        return summary
