"""The chief's side of the ps: every call it makes to the ParameterShard actors, in one place.

A :class:`ShardGroup` creates one actor per shard (pinned to its task's worker address), opens
their data plane, restores them from a checkpoint, reads progress, and moves all of them
together: a consistent hold (every shard paused at one step, for a snapshot or a stop), release,
stop, and the state a checkpoint needs. Each call has a timeout; a shard that does not answer
raises, and the session's recovery decides whether a task was lost.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import torch
from distributed import Future

from dtrain.chief.checkpoint import Checkpoint
from dtrain.deploy.cluster import Connection
from dtrain.plan.compiler import Plan
from dtrain.ps.shard import ParameterShard
from dtrain.spec.errors import RunError
from dtrain.spec.pipeline import PipelineSpec
from dtrain.spec.sections import MAX_STEPS

logger = logging.getLogger(__name__)

# A hold step no shard reaches ("pause nothing yet, tell me your step"): beyond training.steps'
# bound, async overshoot included. A Python int through Dask, never packed into a wire header.
NEVER = 2 * MAX_STEPS


def task_host(address: str) -> str:
    """The host of a worker address (``tcp://[::1]:4000`` -> ``::1``)."""
    return address.split("://")[-1].rsplit(":", 1)[0].strip("[]")


class ShardGroup:
    """The ps actors of one generation of a run (see the module docstring)."""

    def __init__(self, conn: Connection, spec: PipelineSpec, plan: Plan, token: str, nan_guard: bool = False):
        self.conn = conn
        self.client = conn.client
        self.spec = spec
        self.plan = plan  # replaced by the session after a recovery (new worker addresses)
        self.token = token
        self.nan_guard = nan_guard
        self.generation = 0
        self.handles: list[Any] = []
        self.futures: list[Future] = []
        self.data_plane: dict[str, Any] | None = None
        self._secret = secrets.token_bytes(32)
        # Replica connections the ps data planes served (all generations), and through shared memory.
        self.data_plane_counts = {"connections": 0, "shared_memory_connections": 0}

    # ------------------------------------------------------------------ creation
    def _config(self, index: int) -> dict[str, Any]:
        t = self.spec.training
        return {
            "index": index, "mode": t.mode, "steps": t.steps, "generation": self.generation,
            "holds_global_step": self.plan.shards[index].holds_global_step,
            "barrier_timeout_s": t.barrier_timeout_s, "summary_every": self.spec.summary.every_steps,
            "nan_guard": self.nan_guard,
            "num_replicas": self.plan.num_replicas, "replicas_to_aggregate": self.plan.replicas_to_aggregate,
            "max_staleness": t.max_staleness, "optimizer": self.spec.optimizer.model_dump(),
            "torch_threads": t.torch_threads,
        }

    def create(self, init: list[torch.Tensor]) -> None:
        """One actor per shard, pinned to its task's worker address, initialised with ``init``."""
        self.handles, self.futures = [], []
        for shard, values in zip(self.plan.shards, init, strict=True):
            addr = self.conn.tasks[shard.task]
            data = self.client.scatter(values, workers=[addr], direct=True, hash=False)
            fut = self.client.submit(ParameterShard, self._config(shard.index), data, actor=True,
                                     workers=[addr], allow_other_workers=False, pure=False,
                                     key=f"dtrain-ps-{shard.index}-g{self.generation}-{self.token}")
            self.futures.append(fut)
        self.handles = [f.result(timeout=self.spec.cluster.wait_s) for f in self.futures]
        self.data_plane = None
        if self.spec.training.transport == "socket" and self.spec.training.replication == "between_graph":
            self.data_plane = self._open_data_plane()

    def _open_data_plane(self) -> dict[str, Any]:
        """Each ps actor opens a listener on its worker's host; replicas get the endpoints and a
        per-run secret through Dask (the control plane: TLS-protected when the cluster is)."""
        tls = None
        if self.spec.cluster.security is not None:
            from dtrain.deploy.cluster import security_paths

            files = security_paths(self.spec) or {}
            tls = {name: (Path(files[f"{name}_file"]).read_text() if files.get(f"{name}_file") else None)
                   for name in ("ca", "cert", "key")}
        wire = self.spec.training.wire_dtype
        endpoints = [tuple(call(handle.open_data_plane(self._secret, task_host(self.conn.tasks[shard.task]), tls, wire)))
                     for shard, handle in zip(self.plan.shards, self.handles, strict=True)]
        return {"endpoints": endpoints, "secret": self._secret, "tls": tls, "wire_dtype": wire,
                "shared_memory": self.spec.training.shared_memory}

    def close_data_plane(self) -> None:
        if self.data_plane is None:
            return
        counts = self.data_plane_counts
        for s in self.handles:
            try:
                served = call(s.close_data_plane(), timeout=5)
                counts["connections"] += served["connections"]
                counts["shared_memory_connections"] += served["shared_memory"]
            except Exception as exc:  # a lost shard's listener died with its process
                logger.debug("close_data_plane failed: %s", exc)
        self.data_plane = None

    def restore(self, checkpoint: Checkpoint) -> None:
        """Set every shard (params, optimizer state, step) from one checkpoint."""
        states = checkpoint.payload["shards"]
        if len(states) != len(self.handles) or any(
                st["params"].numel() != s.numel for st, s in zip(states, self.plan.shards, strict=True)):
            raise RunError(f"{checkpoint.path} was written for a different model or placement "
                           f"({len(states)} shard(s)); use another --run-dir")
        for shard, state in zip(self.handles, states, strict=True):
            call(shard.set_state(state))

    def refs(self) -> list[tuple[str, str]]:
        """``(worker address, actor key)`` per shard: replicas rebuild their handles from these."""
        return [(self.conn.tasks[s.task], f.key) for s, f in zip(self.plan.shards, self.futures, strict=True)]

    # ------------------------------------------------------------------ reads
    def stats(self, timeout: float = 10) -> dict[str, Any]:
        """Shard 0's progress: step, records, errors, local steps (drains its records)."""
        return call(self.handles[0].stats(), timeout=timeout)

    def pull_params(self) -> list[torch.Tensor]:
        return [call(s.get_params())[0] for s in self.handles]

    def steps(self, timeout: float = 5) -> list[int]:
        return [call(s.current_step(), timeout=timeout) for s in self.handles]

    # ------------------------------------------------------------------ moving all shards together
    def request_stop(self) -> None:
        for s in self.handles:
            try:
                call(s.request_stop(), timeout=10)
            except Exception as exc:  # a lost shard cannot be stopped; its replicas time out
                logger.debug("request_stop failed: %s", exc)

    def hold_consistent(self) -> list[int]:
        """Pause applies with every shard at one step; returns the steps.

        Async: at once. Sync: at the newest step any shard has reached, once the lagging shards
        have applied it (they are at most one step behind, and the replicas' gradients for that
        step are already on their way)."""
        if self.spec.training.mode == "async":
            return [call(s.hold()) for s in self.handles]
        target = max(call(s.hold(NEVER)) for s in self.handles)
        steps: list[int] = []
        for _ in range(5):
            for s in self.handles:
                call(s.hold(target))
            steps = [call(s.wait_held(), timeout=self.spec.training.barrier_timeout_s + 5) for s in self.handles]
            if min(steps) == max(steps):
                break
            target = max(steps)
        return steps

    def release(self) -> None:
        for s in self.handles:
            try:
                call(s.release(), timeout=10)
            except Exception as exc:  # a lost shard: recovery will replace it
                logger.debug("release failed: %s", exc)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every shard's state (params, optimizer state, step) at one consistent step."""
        try:
            self.hold_consistent()
            return [call(s.get_state(), timeout=60) for s in self.handles]
        finally:
            self.release()

    def stop_consistently(self) -> None:
        """A hook's stop: in sync mode every shard stops at the same step (held first, so no step
        lands on one shard but not another); async simply stops."""
        if self.spec.training.mode == "sync":
            try:
                self.hold_consistent()
                self.request_stop()
            finally:
                self.release()
        else:
            self.request_stop()

    # ------------------------------------------------------------------ recovery support
    def grant_barrier_grace(self, seconds: float) -> None:
        for s in self.handles:
            try:
                call(s.barrier_grace(seconds), timeout=5)
            except Exception as exc:  # a shard that does not answer is handled as lost next
                logger.debug("barrier_grace failed: %s", exc)

    def excuse(self, lost_replicas: list[int]) -> None:
        """Sync: complete, on every shard behind the leading one, its step without the lost
        replicas' gradients (see ``ParameterShard.excuse``)."""
        try:
            steps = self.steps()
            top = max(steps)
            for s, step in zip(self.handles, steps, strict=True):
                for i in lost_replicas if step < top else []:
                    call(s.excuse(i, step), timeout=self.spec.training.barrier_timeout_s + 5)
        except Exception as exc:  # a shard that does not answer is handled as lost next
            logger.debug("excuse failed: %s", exc)


def call(future: Any, timeout: float = 30.0) -> Any:
    """The result of an actor call, waiting at most ``timeout`` seconds."""
    return future.result(timeout=timeout)
