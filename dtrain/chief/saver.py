"""The chief's checkpoint saver, with the meaning of TensorFlow's CheckpointSaverHook.

:class:`Saver` decides when a checkpoint is due (``checkpoint.every_steps`` or
``checkpoint.every_secs``), snapshots every shard at one consistent step and writes it through
:mod:`dtrain.chief.checkpoint` (atomic files, retention). Like the CheckpointSaverHook, a fresh
run saves once right after initialisation (the initial step), then at each interval, and once
at the end.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dtrain.spec.errors import RunError

from . import checkpoint as ckpt_io
from . import data_report
from .shards import checkpoint_layout

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session

logger = logging.getLogger(__name__)


class Saver:
    """Checkpoint cadence and saving for one session (see the module docstring)."""

    def __init__(self, session: Session):
        self.session = session
        self.last_step = 0
        self.last_time = time.monotonic()
        self.written: list[str] = []
        self.saved: list[tuple[int, float]] = []  # (step, time) of each checkpoint written: the page's marks

    def restored(self, step: int) -> None:
        """The ps was restored from the checkpoint at ``step``: the next interval counts from it."""
        self.last_step, self.last_time = step, time.monotonic()

    def save(self, stop: bool = False) -> Path | None:
        """Snapshot every shard at one consistent step and write it atomically; with ``stop``,
        every shard stops at that step too (the interrupt path).

        Applies pause for the snapshot: in async mode at once; in sync mode at the newest step any
        shard has reached, once the lagging shards have applied it (they are at most one step
        behind, and the replicas' gradients for that step are already on their way). A sync
        snapshot whose shards still disagree, or parameters that became non-finite, are never
        written (RunError): a checkpoint must always be safe to resume from.
        """
        s = self.session
        spec = s.spec.checkpoint
        if spec is None:
            return None
        t0 = time.monotonic()
        states = s.shards.snapshot(stop=stop)
        steps = [int(st["step"]) for st in states]
        if s.spec.training.mode == "sync" and len(set(steps)) != 1:
            raise RunError(f"the shards did not agree on one step for a checkpoint ({steps}); no checkpoint written")
        for i, st in enumerate(states):
            if not bool(torch.isfinite(st["params"]).all()):
                raise RunError(f"the parameters of shard {i} became non-finite (NaN or inf) at step {st['step']}; "
                               "no checkpoint written (lower optimizer.lr, check the data, or add a nan_guard hook "
                               "to stop at the first non-finite gradient)")
        step = steps[0]
        local = {str(k): v for k, v in s.local_steps.items()}
        path = ckpt_io.save(s.run_dir, step, states, spec_data=s.spec.model_dump(mode="json"),
                            pipeline_hash=s.plan.pipeline_hash,
                            replicas={"local_steps": local, **data_report.positions(s, step)},
                            layout=checkpoint_layout(s.spec, s.plan), keep=spec.keep,
                            keep_every_n_hours=spec.keep_every_n_hours)
        self.last_step, self.last_time = step, time.monotonic()
        self.written.append(path.name)
        self.saved.append((step, time.time()))
        logger.info("checkpoint %s (%.2f s)", path.name, time.monotonic() - t0)
        for h in s.hooks:
            h.on_checkpoint(step, str(path))
        return path

    def due(self) -> bool:
        spec = self.session.spec.checkpoint
        step = self.session.global_step
        if spec is None or step == self.last_step:
            return False
        if spec.every_steps and step // spec.every_steps > self.last_step // spec.every_steps:
            return True
        return bool(spec.every_secs and time.monotonic() - self.last_time >= spec.every_secs)

    def before_failing(self, failure: str) -> None:
        """A replica failed (a shard that cannot be read, its own error): keep the last good step."""
        s = self.session
        if s.spec.checkpoint is None or s.driver is not None:
            return
        try:
            path = self.save(stop=True)
            logger.warning("%s; checkpoint %s written first", failure, path.name if path else None)
        except Exception as exc:
            logger.warning("could not checkpoint before failing: %s", exc)
