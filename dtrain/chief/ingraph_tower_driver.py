"""In-graph sync replication over towers: the graph built once, run by the coordinator each step.

:class:`TowerDriver` is what ``training.replication: in_graph`` with ``mode: sync`` runs on the
socket data plane (``training.transport: socket``, the default) when every replica is in every
step (``Plan.lockstep``). Like TensorFlow's client, the driver builds the graph once: a tower actor
per worker task (``dtrain.worker.ingraph_tower_actor.Tower``) and each shard's data plane, opened with
this driver's secret. Then the coordinator decides each global step ``v`` and runs it: it sends
every tower the step (an actor call straight to the worker: no task, no scheduler), the towers
compute their slices of the step's batch and push over the data plane, each shard applies the
mean of the N gradients once all are in, and each tower answers with the step's figures. The
result is the graph path's: the same sum of the same N gradients, scaled by 1/N, on every shard.

One actor call costs about a millisecond of CPU on each side (Dask's comm, TLS on a TLS
cluster), which on a busy 2-core machine is a tenth of a step: so each call carries the next
``STEPS_PER_CALL`` steps (``step(v, count)``, each step still decided here, numbered, and answered
with its own figures, as TensorFlow's ``iterations_per_loop`` runs several steps per
``session.run``), and ``TOWER_WINDOW`` calls are in flight, so a tower has its next steps queued
and never waits for the coordinator between steps. A stop from the ps (``training.steps``, a
hook's stop, nan_guard) reaches every tower in its next reply, and the steps still queued are
skipped; :meth:`stop` ends after the steps in flight (at most ``TOWER_WINDOW * STEPS_PER_CALL``).

Ends, stops, holds and failures are those of :class:`~dtrain.chief.ingraph.InGraphDriver`: the
loop ends at ``training.steps``, when a shard says stop (every tower sees it in its reply) or
after :meth:`stop` with the steps in flight finished; a checkpoint hold pauses the pushes on the
ps; a failed tower step fails the step (named by tower and step), and a tower whose worker cannot
be reached is given a few seconds, so the session sees the lost worker first and recovers. At the
end the towers are closed and the shards' data planes too (a later driver opens its own).

The graph path (``InGraphDriver``: one Dask graph per step, gradients through Dask) remains for
``transport: dask``, async in-graph (``ingraph_async``) and a sync run that aggregates fewer
replicas than it has (``replicas_to_aggregate`` below the count): :func:`~dtrain.chief.drivers.new_driver`
chooses.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import secrets
import time
from collections import deque
from concurrent.futures import CancelledError
from typing import Any

from distributed import wait

from dtrain.plan.assign import task_host
from dtrain.plan.compiler import Plan
from dtrain.plan.job import replica_job
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.ingraph_tower_actor import Tower, close_plane, open_plane

from .ingraph import POLL_S, InGraphDriver, _Aborted, _StepError

logger = logging.getLogger(__name__)

LOST_GRACE_S = 10.0  # a tower that cannot be reached: time for the session to see its worker lost
# Calls in flight, and steps per call (see the module docstring): each tower has its next steps
# queued, so a coordinator that answers late (a busy machine, a slow link to the client) never
# leaves a tower idle; stop() ends after these.
TOWER_WINDOW = 2
STEPS_PER_CALL = 4


def uses_towers(spec: PipelineSpec, plan: Plan) -> bool:
    """Whether in-graph sync runs on towers (else one Dask graph per step): see the module docstring."""
    t = spec.training
    return t.mode == "sync" and t.transport == "socket" and plan.lockstep


class TowerDriver(InGraphDriver):
    """In-graph sync replication driven step by step over towers (see the module docstring); the
    public API of :class:`~dtrain.chief.ingraph.InGraphDriver`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._towers: list[Any] = []  # Actor handles, in replica order
        self._tower_futures: list[Any] = []
        self._opened = False

    # ------------------------------------------------------------------ building the graph
    def _begin(self) -> tuple[int, bool]:
        """Read shard 0's (step, stopped), open every shard's data plane with a fresh secret and
        create the towers at that step."""
        c = self.client
        start, stopped = self._read_start()
        secret = secrets.token_bytes(32)
        assert c.scheduler is not None  # a connected client
        tls = True if str(c.scheduler.address).startswith("tls://") else None  # each process's own certificate
        planes = [c.submit(open_plane, key, secret, task_host(addr), tls, self.timeout, key=self._key(-1, f"plane{s}"),
                           **self._pin(addr)) for s, (addr, key) in enumerate(self.shard_refs)]
        self._opened = True
        self._wait(planes, "opening the shards' data planes", {f.key: f"shard {s}'s data plane"
                                                               for s, f in enumerate(planes)})
        t = self.spec.training
        data_plane = {"endpoints": [tuple(f.result()) for f in planes], "secret": secret, "tls": tls,
                      "wire_dtype": "float32", "shared_memory": t.shared_memory}
        self._tower_futures = [
            c.submit(Tower, replica_job(self.spec, self.plan, r), data_plane, start, key=self._key(-1, f"tower{r}"),
                     actor=True, **self._pin(addr)) for r, addr in enumerate(self.replica_addresses)]
        self._wait(self._tower_futures, "starting the towers", {f.key: f"tower {r}"
                                                                for r, f in enumerate(self._tower_futures)})
        self._towers = [f.result() for f in self._tower_futures]
        return start, stopped

    def _call(self, r: int, method: str, *args: Any) -> cf.Future:
        """Tower ``r``'s ``method(*args)`` as a concurrent future (the actor call runs on the
        client's event loop; this thread only waits)."""
        out: cf.Future = cf.Future()
        try:
            call = getattr(self._towers[r], method)(*args)
        except RuntimeError as exc:  # Dask: "Worker holding Actor was lost"
            out.set_exception(ConnectionError(str(exc)))  # (an OSError: the worker is lost, see _failed)
            return out

        async def relay() -> None:
            try:
                result = await call
            except BaseException as exc:  # (the tower's own exception, or the comm's)
                with contextlib.suppress(cf.InvalidStateError):  # (cancelled: nobody waits for it)
                    out.set_exception(exc)
                return
            with contextlib.suppress(cf.InvalidStateError):
                out.set_result(result)

        loop = self.client.loop
        assert loop is not None  # a connected client
        loop.add_callback(relay)
        return out

    # ------------------------------------------------------------------ running it
    def _loop(self) -> None:
        start, stopped = self._begin()
        steps = self.spec.last_step()
        version, ending = start, stopped
        pending: deque[tuple[int, list[cf.Future]]] = deque()
        try:
            while True:
                while not ending and not self._stop.is_set() and len(pending) < TOWER_WINDOW and version < steps:
                    count = min(STEPS_PER_CALL, steps - version)
                    pending.append((version, [self._call(r, "step", version, count) for r in range(len(self._towers))]))
                    version += count
                if not pending:
                    return
                v, calls = pending.popleft()
                for i, results in enumerate(zip(*self._collect(v, calls), strict=True)):
                    ending = ending or self._book(v + i, list(results))
        finally:
            for _v, calls in pending:  # (an error or an abort: their figures are not booked)
                for f in calls:
                    f.cancel()

    def _collect(self, version: int, calls: list[cf.Future]) -> list[list[dict[str, Any]]]:
        """Every tower's figures of the steps sent at ``version``; raises the first failure, named
        after its tower."""
        deadline = time.monotonic() + self.timeout
        while True:
            done, _ = cf.wait(calls, timeout=POLL_S, return_when=cf.FIRST_EXCEPTION)
            for r, f in enumerate(calls):
                exc = f.exception() if f in done else None
                if exc is not None:
                    self._failed(version, r, exc)
            if len(done) == len(calls):
                return [f.result() for f in calls]
            if self._aborted:
                raise _Aborted
            if time.monotonic() > deadline:
                late = [r for r, f in enumerate(calls) if not f.done()]
                raise _StepError(f"in-graph step {version} did not finish in {self.timeout:.0f} s "
                                 f"(training.call_timeout_s): tower(s) {late}; is a ps or worker task lost?")

    def _failed(self, version: int, r: int, exc: BaseException) -> None:
        why = f"in-graph step {version}: tower {r}'s gradient step failed: {type(exc).__name__}: {exc}"
        if isinstance(exc, OSError):
            # The tower's worker is gone (or going): wait, so that the session sees the loss
            # (and recovers from the checkpoint) before it sees this error.
            deadline = time.monotonic() + min(LOST_GRACE_S, self.timeout)
            while not self._aborted and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if self._aborted:
                raise _Aborted
        raise _StepError(why)

    def _book(self, version: int, results: list[dict[str, Any]]) -> bool:
        """Book one finished step; True when the loop should end."""
        stop = any(r["stop"] for r in results)
        refused = [(r["replica"], s, st) for r in results for s, st in enumerate(r["steps"]) if st != version + 1]
        if (refused or not results[0]["steps"]) and not stop:
            _r, s, st = refused[0]
            raise _StepError(f"shard {s} did not apply step {version} (it is at step {st})")
        if refused or not results[0]["steps"]:
            return True  # stopped before this step: not a step of the replicas
        self.global_step = results[0]["steps"][0]
        self._add_step_stats(results)
        return stop or self.global_step >= self.spec.last_step()

    # ------------------------------------------------------------------ the end
    def _outstanding(self) -> list[Any]:
        return []  # (the towers finish or fail their steps by themselves; _release closes them)

    def _release(self, t_start: float) -> None:
        """Close the towers (their connections, their data) and the shards' data planes; finish
        the replicas' stats."""
        infos: list[dict[str, Any] | None] = [None] * len(self.replica_addresses)
        wait_s = 5.0 if self._aborted else min(self.timeout, 30.0)
        closes = [self._call(r, "close") for r in range(len(self._towers))]
        if closes:
            cf.wait(closes, timeout=wait_s)
        for r, f in enumerate(closes):
            if f.done() and f.exception() is None:
                infos[r] = f.result()
            else:
                logger.debug("closing tower %d failed: %s", r, f.exception() if f.done() else "no answer")
        if self._tower_futures:
            self.client.cancel(self._tower_futures, force=True)
        if self._opened:
            closing = [self.client.submit(close_plane, key, key=self._key(-1, f"close{s}"), **self._pin(addr))
                       for s, (addr, key) in enumerate(self.shard_refs)]
            with contextlib.suppress(TimeoutError, CancelledError):
                wait(closing, timeout=wait_s)
        self._towers, self._tower_futures = [], []
        self._finish_stats(t_start, infos)

