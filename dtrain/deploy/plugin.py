"""A scheduler plugin that keeps a run's tasks through the cluster's own scaling.

A cluster scaled down by Dask's adaptive scaling (``cluster.adapt()``) closes the workers it finds
idle, and a ps worker looks idle: its actor runs no task. Retiring it would lose the ps shard
(a recovery from the latest checkpoint) for nothing, and an actor cannot move. ``KeepRunTasks``
answers the scheduler's ``valid_workers_downscaling`` question: a worker holding an actor, or
running one of dtrain's tasks (a replica, a pipeline stage), is never a candidate. Idle workers
still go, and a replica's worker that leaves anyway (preemption, a manual scale-down) is an
elastic leave (docs/elastic.md).

The chief registers it on connecting (``register``, which also registers dtrain's telemetry plugin,
``dtrain.observe.scheduler.TelemetryPlugin``, with ``observe.telemetry``); the scheduler unpickles it, so dtrain must be importable
there (the same environment as the workers). Where it is not, the run goes on and says so.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

logger = logging.getLogger(__name__)

TASK_PREFIX = "dtrain-"  # the keys of every task and actor the chief submits


class KeepRunTasks(SchedulerPlugin):
    """Exclude workers holding actors or running dtrain's tasks from downscaling."""

    name = "dtrain-keep-run-tasks"

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        return [ws for ws in workers
                if not ws.actors and not any(str(ts.key).startswith(TASK_PREFIX) for ts in ws.processing)]


def register(client: Any, plugin: SchedulerPlugin | None = None,
             without: str = "an adaptive cluster may retire a ps worker (a recovery from checkpoint)") -> bool:
    """Register ``plugin`` (default ``KeepRunTasks``) on the client's scheduler; say whether it
    took. ``without``: what the run lacks where it did not (logged with the fix)."""
    plugin = plugin if plugin is not None else KeepRunTasks()
    try:
        client.register_plugin(plugin)
        return True
    except Exception as exc:  # dtrain not importable on a remote scheduler, or an old one
        logger.warning("the scheduler did not take dtrain's %s (%s: %s): %s; install dtrain where the scheduler runs",
                       getattr(plugin, "name", type(plugin).__name__), type(exc).__name__, exc, without)
        return False
