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

from .cluster import Connection, connect
from .compiler import Plan, compile
from .errors import RunDirError, RunError
from .hooks import Hook, NanGuardHook, StepContext, build_hooks
from .layout import ShardLayout
from .metrics import JsonlSink, TensorBoardSink
from .model import build_model
from .ps import ParameterShard
from .replica import dataset_for, evaluate
from .spec import PipelineSpec
from .tasks import replica_task

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
        from .graph import run_graph

        return run_graph(spec, client=client, scheduler=scheduler, processes=processes)
    with connect(spec, client=client, scheduler=scheduler, processes=processes) as conn:
        session = Session(spec, conn, run_dir, resume=resume, progress=progress)
        # Actor handles find their client through the "current client" (this is not made the
        # process-wide default client, which belongs to the user).
        with conn.client.as_current():
            return session.run()


class Session:
    """One training run on a connected cluster (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, conn: Connection, run_dir: Path, resume: bool = False,
                 progress: Callable[[dict[str, Any]], None] | None = None):
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
        self.hooks: list[Hook] = build_hooks(spec.hooks)
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
        }

    def create_shards(self, init: list[torch.Tensor]) -> None:
        """One actor per shard, pinned to its task's worker address."""
        self.shards, self.shard_futures = [], []
        for shard, values in zip(self.plan.shards, init):
            addr = self.conn.tasks[shard.task]
            data = self.client.scatter(values, workers=[addr], direct=True, hash=False)
            fut = self.client.submit(ParameterShard, self._shard_config(shard.index), data, actor=True,
                                     workers=[addr], allow_other_workers=False, pure=False,
                                     key=f"dtrain-ps-{shard.index}-g{self.generation}-{self.token}")
            self.shard_futures.append(fut)
        self.shards = [f.result(timeout=self.spec.cluster.wait_s) for f in self.shard_futures]

    def shard_refs(self) -> list[tuple[str, str]]:
        return [(self.conn.tasks[s.task], f.key) for s, f in zip(self.plan.shards, self.shard_futures)]

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
    def submit_replicas(self) -> None:
        refs = self.shard_refs()
        self.replica_futures = []
        for r in self.plan.replicas:
            addr = self.conn.tasks[r.task]
            self.replica_futures.append(self.client.submit(
                replica_task, self.spec, self.plan, r.index, refs, workers=[addr], allow_other_workers=False,
                pure=False, key=f"dtrain-replica-{r.index}-g{self.generation}-{self.token}"))

    def _replica_failure(self) -> str | None:
        for r, fut in zip(self.plan.replicas, self.replica_futures):
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
            torch.manual_seed(self.spec.training.seed)
            init_model = build_model(self.spec)
            init = self.layout.pack(dict(init_model.named_parameters()))
            self.create_shards(init)
            for h in self.hooks:
                h.begin(self)
            self.t_train = time.time()
            self.submit_replicas()
            self._monitor()
            self.train_s = time.time() - self.t_train
            model, final_eval = self._finish(init_model)
            status = "completed"
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted"
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
        return Result(summary=summary, model=model, run_dir=self.run_dir, plan=self.plan)

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
        while True:
            stats = self._call(self.shards[0].stats(), timeout=30)
            self.global_step = stats["step"]
            self.dropped_stale = stats["dropped_stale"]
            self.samples = stats["samples"]
            for rec in stats["records"]:
                metrics = {k: rec[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale")}
                metrics["learning_rate"] = lr
                self._log(metrics, rec["step"])
                self.records.append(rec)
                latest = metrics
                every = self.spec.eval.every_steps
                if every and rec["step"] % every == 0 and rec["step"] < self.spec.training.steps:
                    self._evaluate_now(rec["step"])
            if self.global_step != last_step:
                ctx = StepContext(self.global_step, dict(latest))
                for h in self.hooks:
                    h.before_step(ctx)
                for h in self.hooks:
                    h.after_step(ctx)
                if ctx.stop_requested and not stopping:
                    logger.info("stopping: %s", ctx.stop_requested)
                    stopping = True
                    self.request_stop()
                last_step = self.global_step
            if self.progress is not None:
                self.progress({"step": self.global_step, "steps": self.spec.training.steps,
                               "loss": latest.get("loss"), "samples_per_sec": latest.get("samples_per_sec"),
                               "dropped_stale": self.dropped_stale})
            if stats["error"]:
                self.request_stop()
                raise RunError(stats["error"])
            failure = self._replica_failure()
            if failure:
                self.request_stop()
                raise RunError(failure)
            if all(f.status == "finished" for f in self.replica_futures):
                break
            time.sleep(POLL_S)
        self.replica_stats = [f.result() for f in self.replica_futures]

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
        model = self._assemble(model, self.pull_params())
        final_eval = self._eval(model)
        if final_eval:
            self._log({"eval": final_eval}, self.global_step)
        _atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.run_dir / "model.pt")
        return model, final_eval

    def _cancel(self) -> None:
        futures = self.replica_futures + self.shard_futures
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
            "ps_tasks": [s.task for s in self.plan.shards],
        }
        if error:
            summary["error"] = error
        return summary


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import os

    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
