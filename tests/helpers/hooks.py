"""Custom hooks (and one misbehaving model) used by tests/test_hooks.py, named by import path in
pipelines. Hooks run in the client process (the session is the chief), so a module-level list
would do; :class:`RecordingHook` also writes to a file so the record survives anything."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.chief.hooks import Hook, RunView, StepContext

CALLS: list[tuple[str, Any]] = []


class RecordingHook(Hook):
    """Records every callback, in order, to ``path`` (one JSON array per line) and to ``CALLS``."""

    def __init__(self, path: str, tag: str = "rec"):
        self.path = Path(path)
        self.tag = tag
        self.path.write_text("")

    def _record(self, event: str, value: Any = None) -> None:
        CALLS.append((event, value))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps([self.tag, event, value]) + "\n")

    def begin(self, run: RunView) -> None:
        self._record("begin", run.start_step)

    def before_step(self, ctx: StepContext) -> None:
        self._record("before_step", ctx.step)

    def after_step(self, ctx: StepContext) -> None:
        self._record("after_step", ctx.step)

    def on_checkpoint(self, step: int, path: str) -> None:
        self._record("on_checkpoint", [step, path])

    def on_task_lost(self, task: str) -> None:
        self._record("on_task_lost", task)

    def end(self, run: RunView) -> None:
        self._record("end", run.step)


class HalfPushOnLoss(Hook):
    """At the first lost task, pushes a zero gradient for replica 0 to the last shard only: what a
    lone sync replica killed between its pushes to two shards leaves behind, that shard a step
    ahead of the others, made certain. First, as a kill would, it ends the lost replica's pushes (a
    worker closed in-process leaves its task's thread running: fenced off the data plane), and it
    lets a checkpoint hold the replica may have reached go (the chief is busy with this hook).
    A hook sees no ps actor (its :class:`RunView` is read-only): this one finds them on the
    cluster by their keys, ``dtrain-ps-<shard>-g<generation>-<token>`` (chief/ps_shards.py)."""

    def begin(self, run: RunView) -> None:
        self.run, self.done = run, False

    def on_task_lost(self, task: str) -> None:
        if self.done:
            return
        self.done = True
        from distributed import Future, get_client

        from dtrain.chief.elastic import FENCED

        client = get_client()  # the run's: hooks are called under its client (dtrain.chief.runner)
        token = self.run.run_id.rsplit("-", 1)[1]
        shards = self.run.plan.shards
        handles = [Future(f"dtrain-ps-{s.index}-g0-{token}", client).result(timeout=10) for s in shards]
        for h in handles:
            h.set_owner(0, FENCED).result(timeout=30)
        for h in handles:
            h.release().result(timeout=10)
        step = handles[-1].current_step().result(timeout=10)
        handles[-1].push_sync(torch.zeros(shards[-1].numel), 0, step).result(timeout=10)


class NotAHook:
    """Has the callbacks but does not subclass dtrain.Hook: must be refused."""

    def begin(self, run: Any) -> None:  # pragma: no cover - never called
        pass


def read_calls(path: str | Path) -> list[tuple[str, Any]]:
    return [tuple(json.loads(line)[1:]) for line in Path(path).read_text().splitlines() if line]


class NanAfter(nn.Module):
    """A digits MLP whose training forward returns NaN logits from its ``after + 1``-th call on:
    a reliable NaN loss (and NaN gradients) after a known number of good local steps. Each good
    training step sleeps ``sleep_s`` so that the chief (which polls a few times a second) sees
    the steps go by and writes its checkpoints before the NaN."""

    def __init__(self, after: int = 25, sleep_s: float = 0.0, features: int = 64, classes: int = 10):
        super().__init__()
        self.after = after
        self.sleep_s = sleep_s
        self.calls = 0
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                out = out * float("nan")
            elif self.sleep_s:
                time.sleep(self.sleep_s)
        return out


class SummaryHook(Hook):
    """Writes its own summaries at every step it sees: ``custom/half_step`` (the step / 2) and
    ``custom/loss_x2`` (twice the newest loss, as a 0-d tensor) once a loss is known; with
    ``bad``, ``custom/bad`` with that value instead (a misbehaving hook)."""

    def __init__(self, bad: Any = None):
        self.bad = bad

    def after_step(self, ctx: StepContext) -> None:
        if self.bad is not None:
            ctx.summary("custom/bad", self.bad)
            return
        ctx.summary("custom/half_step", ctx.step / 2)
        if ctx.metrics.get("loss") is not None:
            ctx.summary("custom/loss_x2", torch.tensor(2 * ctx.metrics["loss"]))


class StopAtBegin(Hook):
    """Asks for a stop in ``begin`` (the run view's ``request_stop``) and records what the view
    showed at ``begin`` and ``end``."""

    def __init__(self, path: str):
        self.path = Path(path)

    def begin(self, run: RunView) -> None:
        self.seen = {"begin_step": run.step, "start_step": run.start_step, "run_id": run.run_id,
                     "run_dir": str(run.run_dir), "shards": len(run.plan.shards)}
        run.request_stop("asked in begin")

    def end(self, run: RunView) -> None:
        self.seen.update(end_step=run.step, stop_reason=run.stop_reason, records=len(run.records),
                         loss=run.metrics.get("loss"))
        self.path.write_text(json.dumps(self.seen))
