"""The chief's checkpoint saver, with the meaning of TensorFlow's CheckpointSaverHook.

:class:`Saver` decides when a checkpoint is due (``checkpoint.every_steps`` or
``checkpoint.every_secs``). Like the CheckpointSaverHook, a fresh run saves once right after
initialisation (the initial step), then at each interval, and once at the end.

A checkpoint is written by the ps tasks, each its own part, from a snapshot taken at one
consistent step (:meth:`ShardGroup.write_parts`): training stalls only while the shards are held
for the snapshot; the parts are written in the background, and the saver commits the checkpoint
(its manifest, :func:`dtrain.chief.checkpoint.commit`) once every part is durable, polled from the
session's loop. A checkpoint that falls due while the previous one is still being written waits
for it (never two writers on one shard; training is held meanwhile), counted in ``summary.json``'s
``checkpoint_waits``. With ``checkpoint.incremental``, every ``full_every``-th checkpoint is full
and the ones between are deltas of the checkpoint before (:meth:`Saver.save`). The checkpoints at the start, at the end, on an interrupt and before
failing also wait for their own to be committed, and a run that fails commits the one being
written first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.ps.part_writer import BadPartError

from . import checkpoint as ckpt_io
from . import data_report
from .context import RunContext, RunState
from .hooks import Hook
from .ps_shards import ShardGroup, checkpoint_layout

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A checkpoint whose parts are being written."""

    step: int
    directory: Path
    started: float
    replicas: dict[str, Any] = field(default_factory=dict)


class Saver:
    """Checkpoint cadence, writing and committing for one run (see the module docstring): it reads
    the run's context and state, has the shard group write and restore the parts, and tells the
    hooks of each checkpoint committed."""

    def __init__(self, ctx: RunContext, state: RunState, shards: ShardGroup, hooks: list[Hook]):
        self.ctx, self.state, self.shards, self.hooks = ctx, state, shards, hooks
        self.last_step = 0  # the step of the newest checkpoint committed (or restored)
        self.last_time = time.monotonic()
        self._due_step = 0  # the step the cadence counts from (the newest checkpoint started)
        self.written: list[str] = []
        self.pending: _Pending | None = None
        self.waited = 0  # checkpoints that fell due while the previous one was being written
        self.wait_s = 0.0  # and the seconds they waited for it (training held meanwhile)
        self.stalls: list[float] = []  # seconds the shards were held, per checkpoint
        self.write_s: list[float] = []  # seconds from the hold to the commit, per checkpoint
        self.saved: list[tuple[int, float]] = []  # (step, time) of each checkpoint written: the page's marks
        # Incremental checkpoints: the deltas in the newest chain (committed or restored); None:
        # no checkpoint to follow yet (the next one is full).
        self.depth: int | None = None
        self.kinds: list[str] = []  # per checkpoint committed: "full" or "delta" (a part of it a delta)

    def restored(self, step: int) -> None:
        """The ps was restored from the checkpoint at ``step``: the next interval counts from it."""
        self.last_step = self._due_step = step
        self.last_time = time.monotonic()

    def abandon(self) -> None:
        """The shards writing the pending checkpoint are being replaced: it is never committed (its
        directory goes at the next commit)."""
        if self.pending is not None:
            logger.warning("checkpoint of step %d abandoned: its ps tasks are being replaced", self.pending.step)
        self.pending = None

    def save(self, stop: bool = False, wait: bool = True) -> Path | None:
        """Start a checkpoint at one consistent step (with ``stop``, every shard stops there too);
        once the one being written (if any) is committed (counted in ``waited``). With ``wait``,
        returns after this one is committed (its path); without (the periodic checkpoints), once its
        parts are being written: :meth:`poll` commits it.

        The shards refuse to write parameters that became non-finite, and a sync snapshot whose
        shards disagree on the step is never written (RunError): a checkpoint is always safe to
        resume from."""
        if self.ctx.spec.checkpoint is None:
            return None
        if self.pending is not None:  # never two writers on one shard: the next one waits
            self.waited += 1
            t_wait = time.monotonic()
            self.finish(wait=True)
            self.wait_s += time.monotonic() - t_wait
        t0 = time.monotonic()
        step, directory = self.shards.write_parts(lambda st: ckpt_io.begin(self.ctx.run_dir, st), stop=stop,
                                               since=self._since())
        if directory is None:  # a checkpoint of this step is on disk already (a resume that did not move)
            self.last_step = self._due_step = max(self.last_step, step)
            return ckpt_io.checkpoint_dir(self.ctx.run_dir) / f"ckpt-{step:08d}"
        self.stalls.append(time.monotonic() - t0)
        local = {str(k): v for k, v in self.state.local_steps.items()}
        self.pending = _Pending(step, directory, t0, {"local_steps": local, **data_report.positions(self.ctx.spec, self.state, step)})
        self._due_step, self.last_time = step, time.monotonic()
        return self.finish(wait=True) if wait else None

    def _since(self) -> int | None:
        """The checkpoint the next one may be a delta of: the newest committed (or restored), while
        its chain is shorter than ``checkpoint.incremental.full_every`` allows; None: a full one."""
        incremental = self.ctx.spec.checkpoint.incremental
        if incremental is None or self.depth is None or self.depth + 1 >= incremental.full_every:
            return None
        return self.last_step

    def poll(self) -> Path | None:
        """Commit the checkpoint being written once every part is (its path), else None."""
        return self.finish(wait=False) if self.pending is not None else None

    def finish(self, wait: bool = True) -> Path | None:
        """Commit the checkpoint being written when its parts are (``wait``: block until they are)."""
        pending = self.pending
        if pending is None:
            return None
        parts = self.shards.parts_written(pending.directory, wait=wait)
        if parts is None:
            return None
        self.pending = None
        spec = self.ctx.spec.checkpoint
        path = ckpt_io.commit(pending.directory, pending.step, parts,
                              spec_data=self.ctx.spec.model_dump(mode="json"), pipeline_hash=self.state.plan.pipeline_hash,
                              replicas=pending.replicas, layout=checkpoint_layout(self.ctx.spec, self.state.plan), keep=spec.keep,
                              keep_every_n_hours=spec.keep_every_n_hours)
        self.last_step = max(self.last_step, pending.step)
        delta = any(p.get("kind") == "delta" for p in parts)
        self.depth = (self.depth or 0) + 1 if delta else 0
        self.kinds.append("delta" if delta else "full")
        self.written.append(path.name)
        self.saved.append((pending.step, time.time()))
        self.write_s.append(time.monotonic() - pending.started)
        logger.info("checkpoint %s (%.2f s; training held %.3f s)", path.name, self.write_s[-1], self.stalls[-1])
        for h in self.hooks:
            h.on_checkpoint(pending.step, str(path))
        return path

    def commit_pending(self) -> None:
        """A failing or interrupted run still commits the checkpoint its shards were writing (a
        snapshot taken before the failure); a shard that is gone loses it, said in the log."""
        if self.pending is None or not self.shards.handles:
            return
        step = self.pending.step
        try:
            self.finish(wait=True)
        except Exception as exc:
            self.pending = None  # never committed (its directory goes at the next commit)
            logger.warning("the checkpoint of step %d could not be committed: %s", step, exc)

    def restore(self, checkpoint: ckpt_io.Checkpoint) -> ckpt_io.Checkpoint:
        """Restore the shards from ``checkpoint``; one whose part its ps task finds corrupt or
        truncated (the checksums are verified where the parts are read) is moved aside like any
        invalid checkpoint, and the next newest valid one is restored instead. Returns the one used."""
        while True:
            try:
                in_place = self.shards.restore(checkpoint)
                # (the next checkpoint may be a delta of this one where each ps task restored its
                # own part: it counts its tables' changes from it; resharded, it is full)
                self.depth = int(checkpoint.payload.get("depth", 0)) if in_place else None
                return checkpoint
            except BadPartError as exc:
                moved = ckpt_io.quarantine(checkpoint.path)
                logger.warning("checkpoint %s is invalid (%s); moved it to %s and trying the previous one",
                               checkpoint.path.name, exc, moved.parent)
                previous = ckpt_io.latest(self.ctx.run_dir)
                if previous is None:
                    raise ckpt_io.CheckpointError(
                        f"no valid checkpoint in {ckpt_io.checkpoint_dir(self.ctx.run_dir)} ({exc}): moved to "
                        "checkpoints/invalid/; to start over, use another --run-dir") from None
                checkpoint = previous

    def due(self) -> bool:
        spec = self.ctx.spec.checkpoint
        step = self.state.global_step
        if spec is None or step == self._due_step:
            return False
        if spec.every_steps and step // spec.every_steps > self._due_step // spec.every_steps:
            return True
        return bool(spec.every_secs and time.monotonic() - self.last_time >= spec.every_secs)

    def before_failing(self, failure: str) -> None:
        """A replica failed (a shard that cannot be read, its own error): keep the last good step."""
        if self.ctx.spec.checkpoint is None or self.ctx.spec.training.replication == "in_graph":
            return
        try:
            path = self.save(stop=True)
            logger.warning("%s; checkpoint %s written first", failure, path.name if path else None)
        except Exception as exc:
            logger.warning("could not checkpoint before failing: %s", exc)
