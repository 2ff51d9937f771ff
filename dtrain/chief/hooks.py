"""Session hooks, with the meaning of TensorFlow's SessionRunHooks.

The coordinator (the chief) calls them; replicas never do. ``after_step`` is called each time
the coordinator observes the global step advance (it polls the ps a few times a second, so a
hook sees every summary record but not necessarily every single step), with a
:class:`StepContext`. A hook asks for a stop with ``ctx.request_stop(reason)``, or, as in
TensorFlow's MonitoredSession, by raising StopIteration or ``dtrain.OutOfRange`` (a clean stop);
``dtrain.Aborted`` or ``dtrain.Unavailable`` makes the session recover (``chief/recovery.py``);
any other exception fails the run.

Custom hooks subclass :class:`Hook` and are named in YAML by import path::

    hooks:
      - {type: "mypkg.hooks:MyHook", args: {threshold: 0.1}}

``begin`` and ``end`` receive a :class:`RunView`: the run as a hook may see it, read-only (the
step, the start step, the newest metrics and records, the run directory and id, the spec and
plan, the dashboard's address), with ``summary()`` to write a scalar and ``request_stop()``. It
is not the session: a hook cannot rebind what the chief runs on (docs/session.md, "Hook API").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import OutOfRange
from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

from .context import RunContext, RunState
from .metrics import check_summary, format_line

logger = logging.getLogger("dtrain")


@dataclass
class StepContext:
    """What a hook sees: the global step, the newest metrics, a way to stop the run, and a way to
    write its own summaries. ``write`` is the session's metric sinks (None outside a run: the
    summaries are only collected in ``summaries``)."""

    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    stop_requested: str | None = None
    summaries: list[tuple[str, float, int]] = field(default_factory=list)
    write: Callable[[dict[str, Any], int], None] | None = field(default=None, repr=False)

    def request_stop(self, reason: str = "requested by a hook") -> None:
        self.stop_requested = self.stop_requested or reason

    def summary(self, tag: str, value: float, step: int | None = None) -> None:
        """Write a scalar summary (TF's ``tf.summary.scalar``): the record ``{"step": step, "time":
        ..., tag: value}`` in metrics.jsonl and the scalar ``tag`` in TensorBoard's ``tb/``, at
        ``step`` (default: this context's global step). ``tag`` is a non-empty string other than
        dtrain's own metric names; ``value`` a finite number (or a one-element tensor). A bad
        argument raises ValueError, which fails the run like any error of a hook."""
        tag, value, step = check_summary(tag, value, self.step if step is None else step)
        self.summaries.append((tag, value, step))
        if self.write is not None:
            self.write({"time": time.time(), tag: value}, step)


class RunView:
    """What a hook sees of the run in :meth:`Hook.begin` and :meth:`Hook.end`: read-only views of
    the run's context and state (``chief/context.py``), a way to write its own summaries and a
    way to stop the run. Every property is read when asked, so a view kept from ``begin`` sees
    the run as it goes on."""

    def __init__(self, ctx: RunContext, state: RunState, write: Callable[[dict[str, Any], int], None] | None = None,
                 stop: Callable[[str], None] | None = None):
        self._ctx, self._state, self._write, self._stop = ctx, state, write, stop

    @property
    def step(self) -> int:
        """The global step as the chief saw it last."""
        return self._state.global_step

    @property
    def global_step(self) -> int:
        """The same as :attr:`step` (the name the session's attribute had)."""
        return self._state.global_step

    @property
    def start_step(self) -> int:
        """The step this run (a start or a resume) began at."""
        return self._state.start_step

    @property
    def metrics(self) -> dict[str, Any]:
        """The newest summary record's metrics (``loss``, ``samples_per_sec``, ...; empty before the first)."""
        last = self._state.records[-1] if self._state.records else {}
        return {k: last[k] for k in ("time", "loss", "samples_per_sec", "dropped_stale") if k in last}

    @property
    def records(self) -> tuple[dict[str, Any], ...]:
        """Every summary record so far, oldest first (a copy)."""
        return tuple(self._state.records)

    @property
    def stop_reason(self) -> str | None:
        """Why training ended before ``training.steps`` (a hook's request, nan_guard), if it did."""
        return self._state.stop_reason

    @property
    def run_dir(self) -> Path:
        return self._ctx.run_dir

    @property
    def run_id(self) -> str:
        """The run's id, ``<name>-<token>`` (one per start or resume)."""
        return self._ctx.run_id

    @property
    def spec(self) -> PipelineSpec:
        """The pipeline (a copy: changing it changes nothing of the run)."""
        return self._ctx.spec.model_copy(deep=True)

    @property
    def plan(self) -> Plan:
        """The plan the run follows now (frozen; on the workers again after a recovery or a join)."""
        return self._state.plan

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard's address, if the cluster has one."""
        link: str | None = self._ctx.conn.dashboard_link
        return link

    def summary(self, tag: str, value: float, step: int | None = None) -> None:
        """Write a scalar summary at ``step`` (default: the current global step), as
        :meth:`StepContext.summary` does."""
        tag, value, step = check_summary(tag, value, self.step if step is None else step)
        if self._write is not None:
            self._write({"time": time.time(), tag: value}, step)

    def request_stop(self, reason: str = "requested by a hook") -> None:
        """Ask the run to stop cleanly at the next step the chief observes (from ``begin``; in
        ``end`` the run has ended already and this does nothing)."""
        if self._stop is not None:
            self._stop(reason)


class Hook:
    """Base class: every method is a no-op. Override what you need. ``begin`` and ``end`` receive
    the :class:`RunView`, the step callbacks a :class:`StepContext`."""

    def begin(self, run: RunView) -> None:
        """Once, after the ps is initialised and before replicas start."""

    def before_step(self, ctx: StepContext) -> None:
        """Before the coordinator acts on a newly observed step."""

    def after_step(self, ctx: StepContext) -> None:
        """After the coordinator observed the global step advance (and wrote its summaries)."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """After a checkpoint was written."""

    def on_task_lost(self, task: str) -> None:
        """When a ps or worker task was lost (before recovery)."""

    def end(self, run: RunView) -> None:
        """Once, at the end of the run (also after a failure)."""


class StopAtStepHook(Hook):
    """Stop after ``num_steps`` more steps or at ``last_step``."""

    def __init__(self, num_steps: int | None = None, last_step: int | None = None):
        self.num_steps, self.last_step = num_steps, last_step

    def begin(self, run: RunView) -> None:
        if self.last_step is None and self.num_steps is not None:
            self.last_step = run.start_step + self.num_steps

    def after_step(self, ctx: StepContext) -> None:
        if self.last_step is not None and ctx.step >= self.last_step:
            ctx.request_stop(f"stop_at_step: reached step {self.last_step}")


class LoggingHook(Hook):
    """TF's LoggingTensorHook: log the metrics at the first step observed, then every N steps (or
    seconds) after the last line, and with ``at_end`` once more at the end. ``tensors`` chooses the
    metrics (``step 11: loss = 0.1432, learning_rate = 0.1``); the default is the aligned line."""

    def __init__(self, every_steps: int | None = None, every_secs: float | None = None, at_end: bool = False,
                 tensors: list[str] | None = None):
        self.every_steps = every_steps if every_steps or every_secs else 100
        self.every_secs = every_secs
        self.at_end, self.tensors = at_end, tensors
        self._last: tuple[int, float] | None = None  # (step, time) of the last line; None: log the next step
        self._latest: tuple[int, dict[str, Any]] | None = None
        self._start = 0

    def begin(self, run: RunView) -> None:
        # The first line at the first step trained (TF: the first run), a resumed run's too.
        self._last, self._start = None, run.start_step

    def _line(self, step: int, metrics: dict[str, Any]) -> str:
        if self.tensors is None:
            return format_line(step, metrics)
        values = [f"{k} = {_value(metrics.get(k))}" for k in self.tensors]
        return f"step {step}: " + ", ".join(values)

    def after_step(self, ctx: StepContext) -> None:
        if ctx.step <= self._start:  # nothing trained yet (the session's first look at the step)
            return
        self._latest = (ctx.step, dict(ctx.metrics))
        due = self._last is None or bool(
            (self.every_steps and ctx.step - self._last[0] >= self.every_steps)
            or (self.every_secs and time.monotonic() - self._last[1] >= self.every_secs))
        if due:
            logger.info("%s", self._line(ctx.step, ctx.metrics))
            self._last = (ctx.step, time.monotonic())

    def end(self, run: RunView) -> None:
        if not self.at_end:
            return
        step, metrics = self._latest or (run.step, {})
        last = next((r for r in reversed(run.records) if r.get("loss") is not None), None)
        if last is not None and last["step"] >= step:  # the final summary record, after the last poll
            metrics = {**metrics, **{k: last[k] for k in ("loss", "samples_per_sec", "dropped_stale") if k in last}}
        logger.info("%s", self._line(max(step, run.step), metrics))


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("n/a" if v is None else str(v))


class StepCounterHook(Hook):
    """TF's StepCounterHook: global steps per second every N steps (or seconds), logged and
    written as the summary ``global_step/sec`` (metrics.jsonl and TensorBoard)."""

    def __init__(self, every_steps: int | None = None, every_secs: float | None = None):
        self.every_steps = every_steps if every_steps or every_secs else 100
        self.every_secs = every_secs
        self._last = (0, time.monotonic())
        self.rates: list[float] = []

    def begin(self, run: RunView) -> None:
        # A resumed run starts past step 0: its steps before the resume are not this run's rate.
        self._last = (run.start_step, time.monotonic())

    def after_step(self, ctx: StepContext) -> None:
        step0, t0 = self._last
        now = time.monotonic()
        if (self.every_steps and ctx.step - step0 >= self.every_steps) or \
                (self.every_secs and now - t0 >= self.every_secs):
            rate = (ctx.step - step0) / max(now - t0, 1e-9)
            self.rates.append(rate)
            logger.info("global_step/sec: %.1f", rate)
            ctx.summary("global_step/sec", rate)
            self._last = (ctx.step, now)


class NanGuardHook(Hook):
    """TF's NanTensorHook: a NaN or inf loss (or gradient) stops the run; the ps refuses that
    update, so the parameters and the last checkpoint stay good. ``mode: fail`` (TF's
    fail_on_nan_loss=True): the run fails with an error; ``mode: warn``: a warning, and the run
    stops cleanly (final checkpoint, evaluation and model.pt, summary ``stop_reason``). (The ps
    does the detection: the session turns ``nan_guard`` on for every shard when this hook is
    listed.)"""

    def __init__(self, mode: str = "fail"):
        self.mode = mode


def nan_stop(hooks: list[Hook], error: str) -> bool:
    """Whether the ps's ``error`` is a nan_guard's that a ``mode: warn`` hook turns into a clean stop."""
    return error.startswith("nan_guard:") and any(isinstance(h, NanGuardHook) and h.mode == "warn" for h in hooks)


def call_step_hooks(hooks: list[Hook], ctx: StepContext) -> None:
    """Every hook's ``before_step``, then every ``after_step``. StopIteration or OutOfRange from a
    hook is a clean stop (TF's MonitoredSession swallows them and should_stop() is true); any other
    exception propagates: a transient one to a recovery, the rest to a failed run."""
    try:
        for h in hooks:
            h.before_step(ctx)
        for h in hooks:
            h.after_step(ctx)
    except (StopIteration, OutOfRange) as exc:
        ctx.request_stop(f"{type(exc).__name__} from a hook" + (f": {exc}" if str(exc) else ""))


BUILTIN: dict[str, type[Hook]] = {
    "stop_at_step": StopAtStepHook,
    "logging": LoggingHook,
    "step_counter": StepCounterHook,
    "nan_guard": NanGuardHook,
}


def build_hooks(specs: list[Any]) -> list[Hook]:
    """Hook objects for the ``hooks:`` section (builtins by name, custom ones by import path).

    A custom hook that cannot be imported, is not a :class:`Hook` subclass, or rejects its ``args``
    raises :class:`~dtrain.errors.SpecError` naming ``hooks[i]`` (the CLI exits 2; nothing started).
    """
    from dtrain.model.build import import_object
    from dtrain.spec.errors import Problem, SpecError

    hooks: list[Hook] = []
    for i, h in enumerate(specs):
        if h.type in BUILTIN:
            cls = BUILTIN[h.type]
            if cls is StopAtStepHook:
                hooks.append(StopAtStepHook(h.num_steps, h.last_step))
            elif cls is LoggingHook:
                hooks.append(LoggingHook(h.every_steps, h.every_secs, at_end=h.at_end, tensors=h.tensors))
            elif cls is StepCounterHook:
                hooks.append(StepCounterHook(h.every_steps, h.every_secs))
            elif cls is NanGuardHook:
                hooks.append(NanGuardHook(h.mode))
            else:
                hooks.append(cls())
            continue
        try:
            cls = import_object(h.type)
        except (ImportError, ValueError) as exc:
            raise SpecError([Problem(f"custom hook {h.type!r} cannot be imported: {exc}",
                                     path=f"hooks[{i}].type")]) from None
        if not (isinstance(cls, type) and issubclass(cls, Hook)):
            what = f"class {cls.__name__}" if isinstance(cls, type) else type(cls).__name__
            raise SpecError([Problem(f"custom hook {h.type!r} is a {what}, not a subclass of dtrain.Hook "
                                     "(from dtrain import Hook)", path=f"hooks[{i}].type")])
        try:
            hooks.append(cls(**h.args))
        except TypeError as exc:
            raise SpecError([Problem(f"custom hook {h.type!r} rejects its args {h.args!r}: {exc}",
                                     path=f"hooks[{i}].args")]) from None
    return hooks
