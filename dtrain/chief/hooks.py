"""Session hooks, with the meaning of TensorFlow's SessionRunHooks.

The coordinator (the chief) calls them; replicas never do. ``after_step`` is called each time
the coordinator observes the global step advance (it polls the ps a few times a second, so a
hook sees every summary record but not necessarily every single step), with a
:class:`StepContext`. A hook asks for a stop with ``ctx.request_stop(reason)``.

Custom hooks subclass :class:`Hook` and are named in YAML by import path::

    hooks:
      - {type: "mypkg.hooks:MyHook", args: {threshold: 0.1}}
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .metrics import format_line

logger = logging.getLogger("dtrain")


@dataclass
class StepContext:
    """What a hook sees: the global step, the newest metrics, and a way to stop the run."""

    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    stop_requested: str | None = None

    def request_stop(self, reason: str = "requested by a hook") -> None:
        self.stop_requested = self.stop_requested or reason


class Hook:
    """Base class: every method is a no-op. Override what you need."""

    def begin(self, session: Any) -> None:
        """Once, after the ps is initialised and before replicas start."""

    def before_step(self, ctx: StepContext) -> None:
        """Before the coordinator acts on a newly observed step."""

    def after_step(self, ctx: StepContext) -> None:
        """After the coordinator observed the global step advance (and wrote its summaries)."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """After a checkpoint was written."""

    def on_task_lost(self, task: str) -> None:
        """When a ps or worker task was lost (before recovery)."""

    def end(self, session: Any) -> None:
        """Once, at the end of the run (also after a failure)."""


class StopAtStepHook(Hook):
    """Stop after ``num_steps`` more steps or at ``last_step``."""

    def __init__(self, num_steps: int | None = None, last_step: int | None = None):
        self.num_steps, self.last_step = num_steps, last_step

    def begin(self, session: Any) -> None:
        if self.last_step is None and self.num_steps is not None:
            self.last_step = session.start_step + self.num_steps

    def after_step(self, ctx: StepContext) -> None:
        if self.last_step is not None and ctx.step >= self.last_step:
            ctx.request_stop(f"stop_at_step: reached step {self.last_step}")


class LoggingHook(Hook):
    """Log the aligned metrics line every N steps (or seconds)."""

    def __init__(self, every_steps: int | None = None, every_secs: float | None = None):
        self.every_steps = every_steps if every_steps or every_secs else 100
        self.every_secs = every_secs
        self._last_step = 0
        self._last_time = time.monotonic()

    def begin(self, session: Any) -> None:
        # Count intervals from where this run starts (a resumed run starts past step 0).
        self._last_step, self._last_time = session.start_step, time.monotonic()

    def after_step(self, ctx: StepContext) -> None:
        due = (self.every_steps and ctx.step // self.every_steps > self._last_step // self.every_steps) or \
              (self.every_secs and time.monotonic() - self._last_time >= self.every_secs)
        if due:
            logger.info("%s", format_line(ctx.step, ctx.metrics))
            self._last_step, self._last_time = ctx.step, time.monotonic()


class StepCounterHook(Hook):
    """Log global steps per second every N steps (or seconds)."""

    def __init__(self, every_steps: int | None = None, every_secs: float | None = None):
        self.every_steps = every_steps if every_steps or every_secs else 100
        self.every_secs = every_secs
        self._last = (0, time.monotonic())
        self.rates: list[float] = []

    def begin(self, session: Any) -> None:
        # A resumed run starts past step 0: its steps before the resume are not this run's rate.
        self._last = (session.start_step, time.monotonic())

    def after_step(self, ctx: StepContext) -> None:
        step0, t0 = self._last
        now = time.monotonic()
        if (self.every_steps and ctx.step - step0 >= self.every_steps) or \
                (self.every_secs and now - t0 >= self.every_secs):
            rate = (ctx.step - step0) / max(now - t0, 1e-9)
            self.rates.append(rate)
            logger.info("global_step/sec: %.1f", rate)
            self._last = (ctx.step, now)


class NanGuardHook(Hook):
    """A NaN or inf loss (or gradient) stops the run with an error; the ps refuses that update,
    so the parameters and the last checkpoint stay good. (The ps does the detection: the
    session turns ``nan_guard`` on for every shard when this hook is listed.)"""


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
            elif cls in (LoggingHook, StepCounterHook):
                hooks.append(cls(h.every_steps, h.every_secs))
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
