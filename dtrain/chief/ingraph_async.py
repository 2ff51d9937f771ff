"""In-graph asynchronous replication: the coordinator builds one small graph per *tower step*.

TensorFlow's distributed guide: "async training is compatible with both forms of replication".
With in-graph replication the client's one graph holds a tower per worker; run asynchronously,
each tower's update op is run on its own, without averaging or a barrier. Here each tower step
``k`` of tower ``r`` is one Dask graph that the chief builds and submits:

- per shard ``s``, a **read** pinned to shard ``s``'s ps worker: the shard's current parameters
  (into a fresh tensor) and its step;
- one **gradient** task pinned to worker task ``r``: the tower's ``k``-th batch, on the
  parameters it read (its model cached in that process, as for sync in-graph);
- per shard ``s``, a **push** pinned to shard ``s``'s ps worker: the shard applies the tower's
  gradient at once (``ParameterShard.push_pull``, as a between-graph async replica's push), its
  version being the step the tower read, so the shard counts its staleness.

Towers progress independently: the driver keeps one step in flight per tower and submits a
tower's next step as soon as its previous one is done (whichever tower finishes first), so a
slow tower never holds the others. The global step advances once per push that shard 0 applied;
each tower's local step counts its applied pushes and positions its data order (a checkpoint
keeps it, and a restored run resumes there). The run ends when shard 0 reaches
``training.steps``, a shard says stop (the session's ``request_stop``, stop_at_step, nan_guard)
or :meth:`~dtrain.chief.ingraph.InGraphDriver.stop` is called; pushes in flight at that moment
are refused by the stopped shards, as in between-graph async.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

from dask.typing import Key
from distributed import Client, Future, wait

from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.tasks import read_shard, tower_gradients, tower_push

from .calls import describe_failure
from .ingraph import POLL_S, InGraphDriver, _Aborted, _StepError


@dataclass
class _TowerStep:
    """One tower step in flight: its futures, a label per task key, and when it times out."""

    local_step: int
    reads: list[Future]
    grad: Future
    pushes: list[Future]
    labels: dict[Key, str]
    deadline: float

    def failure(self) -> str | None:
        """Why this step failed (the first failed task: reads, then the gradient, then pushes)."""
        for f in [*self.reads, self.grad, *self.pushes]:
            if failed := describe_failure(f, self.labels.get(f.key, f"task {f.key}")):
                return failed
        return None


class AsyncInGraphDriver(InGraphDriver):
    """Runs in-graph async replication from the client (see the module docstring); the same
    public API as :class:`~dtrain.chief.ingraph.InGraphDriver`. ``local_steps``: replica index ->
    the pushes it had applied (a checkpoint's), where each tower resumes in its data order."""

    def __init__(self, client: Client, spec: PipelineSpec, plan: Plan, shard_refs: list[tuple[str, str]],
                 tasks: dict[str, str], token: str, local_steps: dict[Any, int] | None = None):
        super().__init__(client, spec, plan, shard_refs, tasks, token)
        local_steps = local_steps or {}
        self._local = [int(local_steps.get(r.index, local_steps.get(str(r.index), 0))) for r in plan.replicas]
        self._towers: dict[int, _TowerStep] = {}
        self._submitted = 0

    def _submit_tower(self, r: int) -> _TowerStep:
        c, k = self.client, self._local[r]
        self._submitted += 1  # in every key: a step that is submitted again never reuses a released key
        v = f"{k}.{self._submitted}"
        labels: dict[Key, str] = {}
        reads = []
        for s, (addr, key) in enumerate(self.shard_refs):
            reads.append(c.submit(read_shard, key, self.timeout, fresh=True, key=self._key(v, f"read{s}-t{r}"),
                                  **self._pin(addr)))
            labels[reads[-1].key] = f"tower {r}'s read of shard {s}"
        grad = c.submit(tower_gradients, self._config[r], self.token, k, *reads, key=self._key(v, f"grad{r}"),
                        **self._pin(self.replica_addresses[r]))
        labels[grad.key] = f"tower {r}'s gradient task"
        pushes = []
        for s, (addr, key) in enumerate(self.shard_refs):
            pushes.append(c.submit(tower_push, key, self.token, s, r, self.timeout, grad,
                                   key=self._key(v, f"push{s}-t{r}"), **self._pin(addr)))
            labels[pushes[-1].key] = f"tower {r}'s push to shard {s}"
        return _TowerStep(k, reads, grad, pushes, labels, time.monotonic() + self.timeout)

    def _outstanding(self) -> list[Future]:
        return [f for t in self._towers.values() for f in (*t.reads, t.grad, *t.pushes)]

    def _loop(self) -> None:
        start, stopped = self._begin()
        steps = self.spec.last_step()
        active = set() if stopped or start >= steps else set(range(len(self.replica_addresses)))
        while True:
            # Every idle tower gets its next step at once: towers never wait for one another.
            for r in sorted(active - self._towers.keys()):
                if self._stop.is_set() or self.global_step >= steps:
                    active.discard(r)
                else:
                    self._towers[r] = self._submit_tower(r)
            if not self._towers:
                return
            with contextlib.suppress(TimeoutError, CancelledError):
                wait([f for t in self._towers.values() for f in t.pushes], timeout=POLL_S,
                     return_when="FIRST_COMPLETED")
            for r, t in sorted(self._towers.items()):
                failure = t.failure()
                if failure:
                    raise _StepError(f"tower {r}'s step {t.local_step}: {failure}")
                if all(f.status == "finished" for f in t.pushes):
                    del self._towers[r]
                    if self._book(r, [f.result() for f in t.pushes]):
                        active.discard(r)
                elif time.monotonic() > t.deadline:
                    raise _StepError(f"tower {r}'s step {t.local_step} did not finish in {self.timeout:.0f} s "
                                     "(training.call_timeout_s); is a ps or worker task lost?")
            if self._aborted:
                raise _Aborted

    def _book(self, r: int, results: list[dict[str, Any]]) -> bool:
        """Book one finished tower step; True when the tower should end."""
        first = results[0]  # shard 0's: it counts the global step and carries the tower's figures
        self.global_step = max(self.global_step, first["step"])
        if first["applied"]:
            self._local[r] += 1
            with self._lock:
                stats = self._stats[r]
                stats.local_steps += 1
                stats.samples += first["samples"]
                stats.compute_s += first["compute_s"]
                stats.device = first["device"]
                stats.final_step = self.global_step
        return any(res["stop"] for res in results) or self.global_step >= self.spec.last_step()

    def _release(self, t_start: float) -> None:
        self._towers.clear()
        super()._release(t_start)
