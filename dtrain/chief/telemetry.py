"""The chief's side of a run's telemetry: figures per interval, findings, totals, the scheduler.

Replicas report their counters as events (``dtrain.worker.tasks.reporter``; the chief subscribes
to the topic), the ps shards answer ``load()`` once per interval (all at once, off the replicas'
path), and the chief turns both into per-interval figures (rates and shares of the interval's
wall time) that go into a training record of metrics.jsonl and TensorBoard, into the findings
of ``dtrain.observe.diagnosis`` (each new one logged once), and to the scheduler as an event
that dtrain's scheduler plugin serves to Prometheus and the dashboard page. ``totals()`` gives
summary.json its ``replicas_stats``, ``shards_stats`` and ``diagnosis`` (docs/observability.md).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from dtrain.observe.diagnosis import diagnose
from dtrain.observe.scheduler import TOPIC, page_link
from dtrain.worker import replica as replica_counters
from dtrain.worker.tasks import REPLICA_TOPIC

from .context import RunContext, RunState
from .ps_shards import ShardGroup
from .recovery import Recovery
from .saver import Saver

logger = logging.getLogger(__name__)

COUNTERS = tuple(replica_counters.COUNTERS)
MARKS = 32  # checkpoints and recoveries per payload (the newest; the scheduler keeps what it has seen)


def _share(part: float, whole: float) -> float | None:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else None


def finding_key(line: str) -> str:
    """What a finding is about, its figures left out: its kind and the replica or shard it names
    (logged once each, however its figures move)."""
    m = re.match(r"[^:]*:(?: (?:replica|shard) \S+)?", line)
    assert m is not None, line  # a finding reads "kind: ..."
    return m.group(0)


def replica_figures(cur: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
    """A replica's figures: its counters, and rates and shares over the span since ``prev``
    (since its start without one)."""
    base = prev or {}
    wall = cur.get("wall_s", 0.0) - base.get("wall_s", 0.0)
    out = {k: cur[k] for k in COUNTERS if k in cur and k != "wall_s"}
    if wall > 0:
        out["steps_per_s"] = (cur.get("steps", 0) - base.get("steps", 0)) / wall
        for k in ("compute", "data", "ps"):
            out[f"{k}_frac"] = _share(cur.get(f"{k}_s", 0.0) - base.get(f"{k}_s", 0.0), wall)
    return out


def shard_figures(cur: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
    """A shard's figures: its counters, applies per second and busy share since ``prev``."""
    base = prev or {}
    wall = cur.get("wall_s", 0.0) - base.get("wall_s", 0.0)
    out: dict[str, Any] = {k: cur[k] for k in ("pushes", "applies", "bytes_in", "bytes_out", "dropped", "staleness", "tables")
           if k in cur}
    if wall > 0 and cur.get("pushes"):
        out["applies_per_s"] = (cur.get("applies", 0) - base.get("applies", 0)) / wall
        out["busy_frac"] = _share(cur.get("busy_s", 0.0) - base.get("busy_s", 0.0), wall)
    return out


class Telemetry:
    """Collects, reports and diagnoses one run's figures (see the module docstring), from the run's
    context and state, the shards' loads, and the saver's and the recovery's marks."""

    def __init__(self, ctx: RunContext, state: RunState, shards: ShardGroup, saver: Saver, recovery: Recovery):
        self.ctx, self.state, self.shard_group, self.saver, self.recovery = ctx, state, shards, saver, recovery
        self.spec = ctx.spec
        self.observe = self.spec.observe
        self.client = ctx.client
        self._unanswered = False  # a report to the scheduler timed out (cluster.scheduler_timeout_s)
        self.run_id = ctx.run_id  # the page, /metrics and the replicas' reports key the run by it, not by name
        self.final: dict[str, Any] | None = None  # summary.json's telemetry keys, once computed
        self.started = time.time()
        self.lock = threading.Lock()
        self.latest: dict[int, dict[str, Any]] = {}  # replica -> counters (earlier attempts added in)
        self._attempt: dict[int, tuple[int, str]] = {}
        self._carried: dict[int, dict[str, float]] = {}
        self._prev_r: dict[int, dict[str, Any]] = {}  # each replica's counters at the last record
        self.shards: dict[int, dict[str, Any]] = {}  # each shard's latest load (the last record's)
        self.findings: list[str] = []
        self._seen: set[str] = set()
        self._last = time.monotonic()
        self.subscribed = False
        try:
            self.client.subscribe_topic(REPLICA_TOPIC, self._on_event)
            self.subscribed = True
        except Exception as exc:  # an old scheduler: the run goes on without live replica figures
            logger.warning("telemetry: could not subscribe to the replicas' reports (%s)", exc)

    # ------------------------------------------------------------------ replicas' reports
    def _on_event(self, event: Any) -> None:
        msg = event[1] if isinstance(event, tuple) and len(event) == 2 else event
        if not isinstance(msg, dict) or msg.get("run") != self.run_id or not isinstance(msg.get("replica"), int):
            return
        i = msg["replica"]
        who = (int(msg.get("attempt", 0)), str(msg.get("worker", "")))
        with self.lock:
            if i in self._attempt and self._attempt[i] != who and i in self.latest:
                # A new attempt (recovery, an elastic rejoin) counts from zero: carry the old one's.
                self._carried[i] = {k: v for k, v in self.latest[i].items() if k in COUNTERS}
            self._attempt[i] = who
            carried = self._carried.get(i, {})
            self.latest[i] = {k: msg.get(k, 0) + carried.get(k, 0) for k in COUNTERS}

    def _task(self, kind: str, index: int) -> str | None:
        items = self.state.plan.replicas if kind == "replica" else self.state.plan.shards
        return items[index].task if index < len(items) else None

    def _variables(self, shard: int) -> list[str]:
        plan = self.state.plan
        names = [v.name for v in plan.variables if v.shard == shard]
        names += [f"{t.name}/part_{p.part}" for t in plan.tables for p in t.parts if p.shard == shard]
        return names

    # ------------------------------------------------------------------ per interval
    def due(self) -> bool:
        return time.monotonic() - self._last >= self.observe.interval_s

    def record(self, step: int, loss: float | None, samples_per_s: float | None = None) -> dict[str, Any]:
        """This interval's figures (``replicas``, ``shards``) for a training record; also checks
        for new findings and hands the figures to the scheduler."""
        self._last = time.monotonic()
        loads = self.shard_group.loads(timeout=5)
        with self.lock:
            latest = {i: dict(c) for i, c in self.latest.items()}
        replicas = {str(i): {"task": self._task("replica", i), **replica_figures(c, self._prev_r.get(i))}
                    for i, c in sorted(latest.items())}
        shards = {str(j): {"task": self._task("shard", j), **shard_figures(c, self.shards.get(j))}
                  for j, c in sorted(loads.items())}
        self._prev_r.update(latest)
        self.shards.update(loads)
        for j in shards:
            shards[j]["variables"] = self._variables(int(j))
        findings = self._diagnose(replicas, shards)
        for line in findings:
            key = finding_key(line)
            if key not in self._seen:
                self._seen.add(key)
                logger.warning("%s", line)
        self._publish({**self._run(), "step": step, "loss": loss, "samples_per_s": samples_per_s,
                       "replicas": replicas, "shards": shards, "diagnosis": findings, **self._marks()})
        return {"replicas": replicas, "shards": shards}

    def _run(self) -> dict[str, Any]:
        """What every payload says of the run: its id and name, when it started and now, its steps,
        and the worker address of each of its tasks (the scheduler adds their memory)."""
        tasks = {s.task for s in self.state.plan.shards} | {r.task for r in self.state.plan.replicas}
        hosts = {t: a for t, a in self.ctx.conn.tasks.items() if t in tasks}
        return {"run": self.run_id, "name": self.spec.name, "started": self.started, "time": time.time(),
                "steps": self.spec.training.steps, "hosts": hosts}

    def _marks(self) -> dict[str, Any]:
        """The newest checkpoints, recoveries (``[step, time]`` each) and evaluation, for the page's
        time axis (the scheduler keeps each once)."""
        out: dict[str, Any] = {"checkpoints": [list(c) for c in self.saver.saved[-MARKS:]],
                               "recoveries": [[r["step"], r["time"]] for r in self.recovery.log[-MARKS:]]}
        if self.state.eval_history:
            ev = self.state.eval_history[-1]
            out["eval"] = {k: ev[k] for k in ("step", "loss", "accuracy", "time") if k in ev}
        return out

    def _diagnose(self, replicas: dict[str, Any], shards: dict[str, Any]) -> list[str]:
        return diagnose(replicas, shards, self.observe, self.spec.training.mode == "async",
                        self.state.plan.num_replicas)

    def _publish(self, payload: dict[str, Any]) -> None:
        if self._unanswered:  # a scheduler that let one report time out: no run-end wait for it again
            return
        try:
            # Client.log_event, with the time any question to the scheduler gets (a stopped one never answers)
            self.client.sync(self.client.scheduler.log_event, topic=TOPIC, msg=payload,  # type: ignore[union-attr]
                             callback_timeout=self.spec.cluster.scheduler_timeout_s)
        except TimeoutError:
            self._unanswered = True
            logger.debug("telemetry: the scheduler did not answer in %g s", self.spec.cluster.scheduler_timeout_s)
        except Exception as exc:  # the scheduler is going away: the run's own records still have it
            logger.debug("telemetry: could not log to the scheduler: %s", exc)

    # ------------------------------------------------------------------ the whole run
    def totals(self) -> dict[str, Any]:
        """summary.json's ``replicas_stats``, ``shards_stats`` and ``diagnosis``: over the run."""
        try:
            self.shards.update(self.shard_group.loads(timeout=5))
        except Exception:  # the ps is gone (a failed run): the last interval's figures stand
            pass
        with self.lock:
            latest = {i: dict(c) for i, c in self.latest.items()}
        for i, st in enumerate(self.state.replica_stats or []):
            if isinstance(st, dict) and "local_steps" in st and i not in self._carried:
                # The replica's own final counters (its result), unless an earlier attempt ran too.
                latest[i] = replica_counters.counters(st)
        replicas = {str(i): {"task": self._task("replica", i), **replica_figures(c, None)}
                    for i, c in sorted(latest.items())}
        shards = {str(j): {"task": self._task("shard", j), **shard_figures(c, None),
                           "variables": self._variables(j)} for j, c in sorted(self.shards.items())}
        diagnosis = self._diagnose(replicas, shards)
        self._publish({**self._run(), "final": True, "step": self.state.global_step, "loss": None,
                       "replicas": replicas, "shards": shards, "diagnosis": diagnosis, **self._marks()})
        return {"replicas_stats": replicas, "shards_stats": shards, "diagnosis": diagnosis}

    def close(self) -> None:
        if self.subscribed:
            try:
                self.client.unsubscribe_topic(REPLICA_TOPIC)
            except Exception as exc:
                logger.debug("telemetry: unsubscribe: %s", exc)
            self.subscribed = False


# ---------------------------------------------------------------------- the session's calls
def start(ctx: RunContext, state: RunState, shards: ShardGroup, saver: Saver, recovery: Recovery
          ) -> Telemetry | None:
    """At the run's start: print the dashboard's address and the dtrain page's, and start
    collecting (between-graph training with ``observe.telemetry``; the scheduler's plugin was
    registered on connecting: ``dtrain.deploy.plugin.register``). Returns the collector, if any."""
    link = ctx.conn.dashboard_link
    if link:
        logger.info("Dask dashboard: %s   dtrain page: %s", link, page_link(link))
    spec = ctx.spec
    if spec.observe.telemetry and not spec.is_graph and spec.training.replication == "between_graph":
        return Telemetry(ctx, state, shards, saver, recovery)
    return None


def attach(t: Telemetry | None, metrics: dict[str, Any], step: int) -> None:
    """Add this interval's figures to a training record when one is due."""
    if t is not None and t.due():
        figures = t.record(step, metrics.get("loss"), metrics.get("samples_per_sec"))
        metrics["replica_stats"], metrics["shard_stats"] = figures["replicas"], figures["shards"]


def summary(t: Telemetry | None) -> dict[str, Any]:
    """summary.json's telemetry keys (computed once, when the run's replicas are done or it failed)."""
    if t is None:
        return {}
    if t.final is None:
        t.final = t.totals()
    return t.final


def close(t: Telemetry | None) -> None:
    if t is not None:
        t.close()
