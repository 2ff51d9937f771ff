"""In-graph replication: the coordinator builds one Dask graph per step (the graph path).

In-graph sync on the socket data plane (the default) runs on towers instead
(``dtrain.chief.ingraph_tower_driver``: no task per step, gradients over the data plane); this graph
path runs in-graph sync with ``training.transport: dask`` or with ``replicas_to_aggregate`` below
the replica count, and is the base of both other drivers (:func:`dtrain.chief.drivers.new_driver` chooses).

Each global step ``v`` is one graph (TensorFlow's in-graph replication, with Dask tasks for ops):

- per shard ``s``, a **read** pinned to shard ``s``'s ps worker: the shard's flat parameters at
  step ``v`` (it depends on that shard's apply of step ``v - 1``, so it never reads early);
- per replica ``r``, a **gradient** task pinned to worker task ``r``: it takes every shard's read,
  checks they are of one step, loads them into a model cached in that process under
  ``(token, r)`` (model, buffers and data iterator live across steps) and returns one flat
  gradient per shard, its loss and its sample count;
- per shard ``s``, a **reduce+apply** pinned to shard ``s``'s ps worker: it sums the N gradients
  into a persistent buffer and applies their mean through the shard actor
  (``ParameterShard.apply_mean``), which advances the shard's step.

Tasks are pinned by worker address with ``allow_other_workers=False``, never by resource: the ps
actor already holds its worker's ``ps`` resource. The reduce and apply tasks find the actor object
in their worker's state and run its coroutine on that worker's event loop, so no actor call
crosses the network on this path and the tasks do not depend on the actor's key (a lost ps fails
the step's tasks, not a hidden dependency). Up to two steps are in flight: step ``v + 1``'s graph is
submitted before step ``v`` finishes, its reads waiting on step ``v``'s applies, so the scheduler
never waits for a client round trip between steps.

In every step every replica contributes, so a replica's local step equals the global step and its
batch is its slice of the single-process batch of that step (``ShardIterator``): N replicas of
batch b give the same updates as one process with batch N*b, and a restore resumes the data order.

That is ``training.mode: sync``. With ``mode: async`` (:func:`dtrain.chief.drivers.new_driver`) the driver is
:class:`~dtrain.chief.ingraph_async.AsyncInGraphDriver`: one graph per tower step, each tower's
gradient applied on arrival, towers independent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import CancelledError
from dataclasses import asdict
from typing import Any

from dask.typing import Key
from distributed import Client, Future, wait

from dtrain.plan.compiler import Plan
from dtrain.plan.job import replica_job
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.replica import ReplicaStats
from dtrain.worker.tasks import read_shard, reduce_apply, release, replica_gradients, shard_state

from .calls import describe_failure

logger = logging.getLogger(__name__)

WINDOW = 2  # steps in flight
POLL_S = 0.2  # how often a waiting driver looks at its stop flag

class _StepError(RuntimeError):
    """A step of the in-graph loop failed; the message says which task and why."""


class _Aborted(Exception):
    """:meth:`InGraphDriver.abort` was called."""


# --------------------------------------------------------------------------------- the driver


class InGraphDriver:
    """Runs in-graph replication from the client: one Dask graph per global step, in a
    background thread, until shard 0 reaches ``spec.training.steps``, a shard says stop (the
    session's ``request_stop``, nan_guard) or :meth:`stop` is called.

    ``shard_refs`` are ``(worker address, actor key)`` per shard, in plan order (what
    ``ShardGroup.refs()`` returns); ``tasks`` maps task keys (``/job:worker/task:0``) to worker
    addresses; ``token`` names the run (cached models are keyed by it).
    """

    def __init__(self, client: Client, spec: PipelineSpec, plan: Plan, shard_refs: list[tuple[str, str]],
                 tasks: dict[str, str], token: str):
        if len(shard_refs) != len(plan.shards):
            raise ValueError(f"{len(shard_refs)} shard reference(s) for the plan's {len(plan.shards)} shard(s)")
        self.client = client
        self.spec = spec
        self.plan = plan
        self.shard_refs = list(shard_refs)
        self.replica_addresses = [tasks[r.task] for r in plan.replicas]
        self.token = token
        self._nonce = uuid.uuid4().hex[:6]  # task keys stay unique if a recovery starts a new driver
        t = spec.training
        self.timeout = t.call_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._finished = False
        self.global_step = 0
        self._stats = [ReplicaStats(r.index) for r in plan.replicas]
        self._held: dict[Any, list[Future]] = {}
        self._pending: deque[tuple[int, list[Future], dict[Key, str]]] = deque()
        self._config: list[Future] = []  # each replica's job (dtrain.plan.job), scattered to its worker
        self._aborted = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Start the step loop in a background thread (returns at once)."""
        if self._thread is not None:
            raise RuntimeError("InGraphDriver.start() was already called")
        self._thread = threading.Thread(target=self._main, name=f"dtrain-ingraph-{self.token}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """The loop has ended (steps reached, stopped, or failed: see :meth:`error`)."""
        return self._finished

    def error(self) -> str | None:
        """Why the loop failed, or None."""
        return self._error

    def stop(self) -> None:
        """Ask the loop to end after the steps in flight (so every shard ends at one step); does
        not wait (see :meth:`join`)."""
        self._stop.set()

    def abort(self) -> None:
        """End now, cancelling the steps in flight: for a recovery, before the shards are restored
        (a late apply of this driver must not land on a restored shard). Does not wait."""
        self._aborted = True
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True when it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._finished

    def replica_stats(self) -> list[dict[str, Any]]:
        """One dict per replica, shaped like ``dataclasses.asdict(ReplicaStats)`` (plus ``worker``
        and ``pid`` once the loop has ended, like between-graph replica results)."""
        with self._lock:
            return [self._stat_dict(s) for s in self._stats]

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _stat_dict(stats: ReplicaStats) -> dict[str, Any]:
        out = asdict(stats)
        out.update(out["extra"].pop("where", {}))
        return out

    def _key(self, version: int | str, what: str) -> str:
        return f"dtrain-ig-{what}-{version}-{self.token}-{self._nonce}"

    def _pin(self, address: str) -> dict[str, Any]:
        return {"workers": [address], "allow_other_workers": False, "pure": False}

    def _submit_step(self, version: int, config: list[Future], previous: list[Future | None]
                     ) -> tuple[list[Future], dict[Key, str]]:
        """Submit step ``version``'s graph; returns its apply futures and a label per task key."""
        c = self.client
        labels: dict[Key, str] = {}
        reads = []
        for s, (addr, key) in enumerate(self.shard_refs):
            after = [previous[s]] if previous[s] is not None else []
            reads.append(c.submit(read_shard, key, self.timeout, *after, key=self._key(version, f"read{s}"),
                                  **self._pin(addr)))
            labels[reads[-1].key] = f"the read of shard {s}"
        grads = []
        for r, addr in enumerate(self.replica_addresses):
            grads.append(c.submit(replica_gradients, config[r], self.token, *reads,
                                  key=self._key(version, f"grad{r}"), **self._pin(addr)))
            labels[grads[-1].key] = f"replica {r}'s gradient task"
        applies = []
        for s, (addr, key) in enumerate(self.shard_refs):
            applies.append(c.submit(reduce_apply, key, self.token, s, self.timeout, reads[s], *grads,
                                    key=self._key(version, f"apply{s}"), **self._pin(addr)))
            labels[applies[-1].key] = f"the reduce+apply of shard {s}"
        # Keep the step's futures alive (and their errors inspectable) until it is booked.
        self._held[version] = reads + grads
        return applies, labels

    def _wait(self, futures: list[Future], what: str, labels: dict[Key, str] | None = None,
              related: Sequence[Future] = ()) -> None:
        """Wait for ``futures``, raising the first error (named after the task that failed first,
        among ``related`` then ``futures``); gives up after call_timeout_s (a task pinned to a lost
        worker's address would wait forever)."""
        deadline = time.monotonic() + self.timeout
        labels = labels or {}
        while True:
            try:
                wait(futures, timeout=POLL_S)
            except (TimeoutError, CancelledError):  # (distributed's cancellations subclass it)
                pass
            if any(f.status in ("error", "cancelled") for f in futures):
                for f in [*related, *futures]:
                    if failed := describe_failure(f, labels.get(f.key, f"task {f.key}")):
                        raise _StepError(f"{what}: {failed}")
            if all(f.status == "finished" for f in futures):
                return
            if self._aborted:
                raise _Aborted
            if time.monotonic() > deadline:
                raise _StepError(f"{what} did not finish in {self.timeout:.0f} s (training.call_timeout_s); "
                                 "is a ps or worker task lost?")

    def _main(self) -> None:
        # distributed.wait and futures find their client through the "current client", which is
        # per thread (a contextvar): make it ours here, never the process-wide default.
        with self.client.as_current():
            self._run()

    def _run(self) -> None:
        t_start = time.perf_counter()
        try:
            self._loop()
        except Exception as exc:
            if not isinstance(exc, _Aborted):
                self._error = f"in-graph replication: {exc}" if isinstance(exc, _StepError) \
                    else f"in-graph replication: {type(exc).__name__}: {exc}"
                logger.debug("in-graph driver failed", exc_info=True)
            # Steps still in flight would only recreate the models that _release drops.
            with contextlib.suppress(Exception):
                self.client.cancel(self._outstanding(), force=True)
        finally:
            self._held.clear()
            self._release(t_start)
            self._config = []
            self._finished = True

    def _begin(self) -> tuple[int, bool]:
        """Read shard 0's (step, stopped) and send each replica's job to its worker once (every
        gradient task refers to it by key)."""
        c = self.client
        start, stopped = self._read_start()
        for r, addr in enumerate(self.replica_addresses):
            self._config.extend(c.scatter([replica_job(self.spec, self.plan, r)], workers=[addr], hash=False,
                                          direct=True))
        return start, stopped

    def _read_start(self) -> tuple[int, bool]:
        """Shard 0's (step, stopped), read by a task on its ps worker: the step the driver starts at."""
        addr0, key0 = self.shard_refs[0]
        first = self.client.submit(shard_state, key0, key=self._key(-1, "state"), **self._pin(addr0))
        self._wait([first], "reading shard 0's step")
        start, stopped = first.result()
        self.global_step = start
        return start, stopped

    def _outstanding(self) -> list[Future]:
        """The futures still in flight (cancelled when the loop fails or is aborted)."""
        return [f for held in self._held.values() for f in held] + \
            [f for _v, applies, _labels in self._pending for f in applies]

    def _loop(self) -> None:
        start, stopped = self._begin()
        steps = self.spec.last_step()
        previous: list[Future | None] = [None] * len(self.shard_refs)
        version = start
        ending = stopped
        pending = self._pending
        while True:
            while not ending and not self._stop.is_set() and len(pending) < WINDOW and version < steps:
                applies, labels = self._submit_step(version, self._config, previous)
                pending.append((version, applies, labels))
                previous = list(applies)
                version += 1
            if not pending:
                break
            v, applies, labels = pending.popleft()
            self._wait(applies, f"in-graph step {v}", labels, self._held[v])
            results = [f.result() for f in applies]
            ending = self._record(v, results) or ending
            del self._held[v], applies, results

    def _record(self, version: int, results: list[dict[str, Any]]) -> bool:
        """Book one finished step; True when the loop should end."""
        stop = any(r["stop"] for r in results)
        refused = [r for r in results if r["step"] != version + 1]
        if refused and not stop:
            r = refused[0]
            raise _StepError(f"shard {r['shard']} did not apply step {version} (it is at step {r['step']})")
        self.global_step = results[0]["step"]
        if refused:
            return True  # stopped before this step (a shard refused it): not a step of the replicas
        self._add_step_stats(results[0]["replicas"])
        return stop or self.global_step >= self.spec.last_step()

    def _add_step_stats(self, replicas: list[dict[str, Any]]) -> None:
        """Add one global step's figures (``samples``, ``compute_s``, ``device`` per replica) to
        every replica's stats."""
        with self._lock:
            for stats, rep in zip(self._stats, replicas, strict=True):
                stats.local_steps += 1
                stats.samples += rep["samples"]
                stats.compute_s += rep["compute_s"]
                stats.device = rep["device"]
                stats.final_step = self.global_step

    def _release(self, t_start: float) -> None:
        """Free the per-run state on the workers and finish the replicas' stats."""
        futures = [self.client.submit(release, self.token, replica=r, key=self._key(-1, f"release-r{r}"),
                                      **self._pin(addr))
                   for r, addr in enumerate(self.replica_addresses)]
        futures += [self.client.submit(release, self.token, shard=s, key=self._key(-1, f"release-s{s}"),
                                       **self._pin(addr))
                    for s, (addr, _key) in enumerate(self.shard_refs)]
        infos: list[dict[str, Any] | None] = [None] * len(self.replica_addresses)
        try:
            with contextlib.suppress(TimeoutError, CancelledError):
                wait(futures, timeout=min(self.timeout, 30.0))
            for r, f in enumerate(futures[:len(infos)]):
                if f.status == "finished":
                    infos[r] = f.result()
        except Exception as exc:  # a lost worker keeps its cache; nothing else to free
            logger.debug("in-graph release failed: %s", exc)
        self._finish_stats(t_start, infos)

    def _finish_stats(self, t_start: float, infos: list[dict[str, Any] | None]) -> None:
        """The replicas' wall and wait times, and where each ran (``infos``: per replica, what its
        release returned, or None)."""
        wall = time.perf_counter() - t_start
        with self._lock:
            for stats, info in zip(self._stats, infos, strict=True):
                stats.wall_s = wall
                stats.wait_s = max(wall - stats.compute_s, 0.0)
                if info is None:
                    continue
                if "buffers" in info:
                    stats.extra["buffers"] = info["buffers"]
                if "wait_s" in info:  # a tower's own figures: waiting for the shards, and for its next step
                    stats.wait_s = info["wait_s"]
                    stats.extra["idle_s"] = info["idle_s"]
                stats.extra["where"] = {"worker": info["worker"], "pid": info["pid"]}
