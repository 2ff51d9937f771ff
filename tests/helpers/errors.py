"""Errors raised on purpose, named by import path in test pipelines: a hook that raises once at a
given step (TF's monitored_session_test raises AbortedError from a hook the same way) and a model
whose first replica to reach a given step stalls once (a real sync barrier timeout)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dtrain
from dtrain.chief.hooks import Hook, StepContext

ERRORS: dict[str, type[BaseException]] = {
    "aborted": dtrain.Aborted, "unavailable": dtrain.Unavailable, "out_of_range": dtrain.OutOfRange,
    "stop_iteration": StopIteration, "runtime": RuntimeError,
}


class RaiseAt(Hook):
    """Raises ``ERRORS[error]`` once, at the first step it sees at or past ``step``; writes every step
    it sees (and the one it raised at, as ``["raised", step]``) to ``path``, one JSON value a line."""

    def __init__(self, step: int, error: str, path: str):
        self.step, self.error, self.path = step, ERRORS[error], Path(path)
        self.fired = False
        self.path.write_text("")

    def _write(self, value: Any) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(value) + "\n")

    def after_step(self, ctx: StepContext) -> None:
        self._write(ctx.step)
        if not self.fired and ctx.step >= self.step:
            self.fired = True
            self._write(["raised", ctx.step])
            raise self.error(f"raised by RaiseAt at step {ctx.step}")


def seen(path: str | Path) -> tuple[list[int], int | None]:
    """What a :class:`RaiseAt` hook wrote: (the steps it saw, the step it raised at)."""
    steps, raised = [], None
    for line in Path(path).read_text().splitlines():
        value = json.loads(line)
        if isinstance(value, list):
            raised = value[1]
        else:
            steps.append(value)
    return steps, raised


class StallOnce(nn.Module):
    """A digits MLP whose training forward, in the first replica to reach its ``at``-th call (by an
    exclusive create of ``flag``), sleeps ``sleep_s`` once: the other replicas' sync barrier (with a
    shorter ``training.barrier_timeout_s``) times out while every process lives."""

    def __init__(self, flag: str, at: int = 20, sleep_s: float = 6.0):
        super().__init__()
        self.flag, self.at, self.sleep_s = flag, at, sleep_s
        self.calls = 0
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                try:
                    os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass
                else:
                    time.sleep(self.sleep_s)
        return self.net(x)
