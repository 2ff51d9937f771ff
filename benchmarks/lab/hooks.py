"""A hook for lab benchmarks: stop a run cleanly when a file appears (the benchmark's timed
window is over), so the run ends ``completed`` however fast it trained. Named in a pipeline as
``{type: "benchmarks.lab.hooks:StopFileHook", args: {path: ...}}`` (the chief runs with
``PYTHONPATH`` at the repository's root)."""

from __future__ import annotations

import os

from dtrain.chief.hooks import Hook, StepContext


class StopFileHook(Hook):
    """``ctx.request_stop`` at the first step observed after ``path`` exists."""

    def __init__(self, path: str):
        self.path = path

    def after_step(self, ctx: StepContext) -> None:
        if os.path.exists(self.path):
            ctx.request_stop(f"stop file {self.path}")
