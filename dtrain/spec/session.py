"""The session's sections: checkpoint (CheckpointSaverHook), summary, eval and hooks."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import MAX_STEPS, WEEK_S, Strict, did_you_mean, quoted
from .errors import CrossFieldErrors

# ------------------------------------------------------------------------ checkpoint/summary/eval


class IncrementalSpec(Strict):
    """Incremental checkpoints: between full ones, only the sparse tables' rows that changed."""

    full_every: int = Field(
        10, ge=2, le=1000,
        description="Every N-th checkpoint is full; the N-1 between are deltas: each holds, per sparse table, only "
                    "the rows written since the checkpoint before (for a table without a vocabulary also the ids "
                    "evicted since), and the dense variables and optimizer state whole. A restore reads the newest "
                    "full checkpoint and the deltas after it; retention keeps every checkpoint a kept delta needs.")


class CheckpointSpec(Strict):
    """CheckpointSaverHook: atomic checkpoints of every shard at one consistent step."""

    every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Save every N global steps (the default: 500; not with every_secs).")
    every_secs: float | None = Field(
        None, gt=0, le=WEEK_S, description="Save every N seconds (at most a week; not with every_steps).")
    keep: int = Field(3, ge=1, description="Keep the newest N checkpoints.")
    keep_every_n_hours: float | None = Field(
        None, gt=0, le=1e6,
        description="Also keep one older checkpoint per N hours (TF's keep_checkpoint_every_n_hours).")
    incremental: IncrementalSpec | None = Field(
        None, description="Write deltas between full checkpoints (sparse tables only): see its full_every. "
                          "Unset: every checkpoint is full.")

    @model_validator(mode="after")
    def _when(self) -> CheckpointSpec:
        # TF's CheckpointSaverHook takes exactly one of save_steps/save_secs (ValueError otherwise).
        if self.every_steps is not None and self.every_secs is not None:
            raise CrossFieldErrors([(("every_secs",), "give every_steps or every_secs, not both "
                                                      "(TF's CheckpointSaverHook takes exactly one)")])
        if self.every_steps is None and self.every_secs is None:
            self.every_steps = 500
        return self


class SummarySpec(Strict):
    """SummarySaverHook: metrics.jsonl and TensorBoard events."""

    every_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Write a summary every N global steps.")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files under tb/.")


class EvalSpec(Strict):
    """Evaluation on the test split."""

    every_steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="Evaluate every N global steps (always at the end).")


LoggedMetric = Literal["loss", "learning_rate", "samples_per_sec", "dropped_stale", "replicas"]


class HookSpec(Strict):
    """A hook: logging | nan_guard | step_counter | stop_at_step, or a custom one by import path."""

    type: str = Field(description="logging | nan_guard | step_counter | stop_at_step | 'package.module:HookClass'.")
    every_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="logging/step_counter: every N global steps.")
    every_secs: float | None = Field(
        None, gt=0, le=WEEK_S, description="logging/step_counter: every N seconds (at most a week).")
    num_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="stop_at_step: stop after N more steps.")
    last_step: int | None = Field(None, ge=1, le=MAX_STEPS, description="stop_at_step: stop at this global step.")
    at_end: bool = Field(False, description="logging: also log the final values at the end of the run.")
    tensors: list[LoggedMetric] | None = Field(
        None, min_length=1, description="logging: the metrics to log (loss | learning_rate | samples_per_sec | "
                                        "dropped_stale | replicas); the default is the aligned progress line.")
    mode: Literal["fail", "warn"] = Field(
        "fail", description="nan_guard: 'fail' ends the run with an error at a non-finite loss or gradient; "
                            "'warn' logs it and stops the run cleanly (TF's fail_on_nan_loss=False).")
    args: dict[str, Any] = Field(default_factory=dict, description="Custom hooks: keyword arguments of the class.")

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in BUILTIN_HOOKS and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", v):
            raise ValueError(f"unknown hook {v!r}{did_you_mean(v, BUILTIN_HOOKS)} "
                             f"(built-in: {quoted(BUILTIN_HOOKS)}; or a custom one as 'package.module:HookClass')")
        return v

    @model_validator(mode="after")
    def _known(self) -> HookSpec:
        if self.type == "stop_at_step" and (self.num_steps is None) == (self.last_step is None):
            raise CrossFieldErrors([((), "stop_at_step needs exactly one of num_steps or last_step, "
                                         "e.g. {type: stop_at_step, num_steps: 100}")])
        if self.type in BUILTIN_HOOKS and self.args:
            raise CrossFieldErrors([(("args",), f"'args' is for custom hooks; {self.type} takes "
                                                "every_steps/every_secs/num_steps/last_step")])
        if self.every_steps is not None and self.every_secs is not None:  # TF: exactly one cadence
            raise CrossFieldErrors([(("every_secs",), f"{self.type}: give every_steps or every_secs, not both")])
        foreign = [k for k in ("at_end", "tensors", "mode") if k in self.model_fields_set
                   and self.type != {"at_end": "logging", "tensors": "logging", "mode": "nan_guard"}[k]]
        if foreign:
            raise CrossFieldErrors([((k,), f"{k!r} is not a key of the {self.type} hook") for k in foreign])
        return self


BUILTIN_HOOKS = ("logging", "nan_guard", "step_counter", "stop_at_step")
