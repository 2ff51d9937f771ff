"""In-graph replication's towers: one per worker task, run one step at a time by the coordinator.

TensorFlow's in-graph replication builds one graph in the client, with a tower per worker and
the aggregation on the ps, and ``session.run`` executes it once per step. Here the chief's driver
(``dtrain.chief.ingraph_tower_driver``) builds that graph once per driver: a :class:`Tower` actor pinned
to each worker task (its model, persistent buffers, data order and data-plane connections live
across steps) and, on each ps worker, the shard's socket data plane (:func:`open_plane`). Each
step the coordinator then runs it: it sends every tower the step (``Tower.step(version)``: a
small message straight to the worker, no scheduler involved; ``count`` consecutive steps per
message), and the tower

- has the parameters of step ``version`` (the previous step's reply, else a ``pull``),
- computes its gradient on its slice of the step's global batch (replica ``r``'s ``version``-th
  batch: N towers of batch b together take one process's batch N*b),
- pushes it to every shard over the data plane (``push_sync``): the shard adds the N towers'
  gradients and applies their mean once the last one is in (``SyncAggregator`` with every
  replica in the quorum: the same sum, then the same scaling by 1/N, as the graph path's reduce
  and ``apply_mean``), and replies with the parameters of step ``version + 1``,

and returns the step's figures (the shards' steps, stop flag, loss, samples, compute time).
The coordinator keeps several steps in flight, so a tower starts step ``v + 1`` the moment step
``v``'s reply is in, never waiting for a round trip to the client; the tower runs the steps in
order whatever order the messages arrive in. No tensor crosses Dask on this path.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from distributed import get_worker
from distributed.utils import sync

from dtrain.plan.job import ReplicaJob

from .buckets import GradBuckets
from .inputs import MemoryBatches
from .replica import ReplicaModel, model_buffers
from .tasks import _local_shard, socket_handles


class Tower:
    """Replica ``job.index``'s tower (a Dask actor on its worker task): see the module docstring.
    ``data_plane``: the shards' endpoints and the driver's secret (``socket_handles``);
    ``start``: the first step the coordinator will run."""

    def __init__(self, job: ReplicaJob, data_plane: dict[str, Any], start: int):
        t = job.settings
        self.job = job
        self.index = index = job.index
        self.timeout = t.call_timeout_s + t.barrier_timeout_s  # a push waits out the others' gradients
        self.worker = str(get_worker().name)
        self.rep = ReplicaModel(job, start_local_step=start, owns_replies=True)
        self.shards = socket_handles(job, data_plane)
        slots = [sh.grad_slots() for sh in self.shards]
        if self.rep.zero_copy and all(s is not None for s in slots):
            # Shared memory: backward writes each gradient straight into the ps's slots.
            self.rep.grad_bufs = [[s[j] for s in slots] for j in range(2)]
        self.buckets: GradBuckets | None = None
        if t.bucket_mb and self.rep.zero_copy and t.microbatches == 1:
            self.buckets = GradBuckets(self.rep.bound, self.shards, max(1, int(t.bucket_mb * 2**20 / 4)))
            if not self.buckets.active:  # no shard's bytes cross a socket
                self.buckets.remove()
                self.buckets = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"dtrain-tower-{index}")
        self._next = start  # the step the next command must be
        self._turn: asyncio.Condition | None = None  # created on the worker's loop
        self._loaded: int | None = None  # the step of the parameters in the model
        self._stopped = False
        self._failed: str | None = None
        self.closed = False
        # Time the tower's thread had nothing to run (its next step not yet sent by the
        # coordinator) and time it waited for the shards' replies: the step's cost around compute.
        self.idle_s = self.wait_s = 0.0
        self._last_end: float | None = None

    # ------------------------------------------------------------------ the coordinator's calls
    async def step(self, version: int, count: int = 1) -> list[dict[str, Any]]:
        """Run steps ``version`` .. ``version + count - 1`` of the coordinator's graph on this tower;
        returns their figures once the shards replied to each (applied, or refused: stopped)."""
        if self._turn is None:
            self._turn = asyncio.Condition()
        async with self._turn:
            # Commands in flight may arrive in any order: step v+1 waits for step v's turn.
            await self._turn.wait_for(lambda: self._next >= version or self.closed)
            if self.closed:
                raise RuntimeError(f"tower {self.index} is closed")
            if version != self._next:
                raise RuntimeError(f"tower {self.index} was sent step {version} after step {self._next - 1}")
            self._next = version + count
            # Queued in order behind the steps before: the tower's thread starts each the moment
            # the previous one's reply is in.
            sent = time.perf_counter()
            done = [self._pool.submit(self._run, v, sent) for v in range(version, version + count)]
            self._turn.notify_all()
        return [await asyncio.wrap_future(d) for d in done]

    async def close(self) -> dict[str, Any]:
        """End the tower: steps not started are dropped, the connections closed. Returns where it
        ran and (replica 0) the model's non-parameter buffers."""
        self.closed = True
        if self._turn is not None:
            async with self._turn:
                self._turn.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sh in self.shards:
            sh.close()
        if self.buckets is not None:
            self.buckets.remove()
        self.rep.batches.close()
        out: dict[str, Any] = {"worker": self.worker, "pid": os.getpid(), "device": str(self.rep.device),
                               "idle_s": self.idle_s, "wait_s": self.wait_s}
        if self.index == 0:
            out["buffers"] = model_buffers(self.rep.model)
        return out

    # ------------------------------------------------------------------ the tower's thread
    def _run(self, version: int, sent: float) -> dict[str, Any]:
        if self._failed is not None:  # a step after a failed one would wait for a barrier forever
            raise RuntimeError(f"tower {self.index}: {self._failed}")
        if self._last_end is not None:
            self.idle_s += max(0.0, sent - self._last_end)
        try:
            return self._step(version)
        except BaseException as exc:
            self._failed = f"step {version} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._last_end = time.perf_counter()

    def _wait(self, futures: list[Any]) -> list[tuple[Any, ...]]:
        t0 = time.perf_counter()
        try:
            return [f.result(timeout=self.timeout) for f in futures]
        except (TimeoutError, FutureTimeout):
            raise TimeoutError(f"tower {self.index}: a ps got no answer in {self.timeout:.0f} s "
                               "(training.call_timeout_s + barrier_timeout_s)") from None
        finally:
            self.wait_s += time.perf_counter() - t0

    def _figures(self, version: int, steps: list[int], stop: bool, loss: float = 0.0, samples: int = 0,
                 compute_s: float = 0.0) -> dict[str, Any]:
        return {"replica": self.index, "version": version, "steps": steps, "stop": stop, "loss": loss,
                "samples": samples, "compute_s": compute_s, "device": str(self.rep.device)}

    def _step(self, version: int) -> dict[str, Any]:
        rep = self.rep
        if self._stopped:  # a command sent before the stop was seen: nothing to run
            return self._figures(version, [], True)
        if self._loaded != version:  # the first step, or after a refused push: read the step's parameters
            replies = self._wait([sh.pull(version) for sh in self.shards])
            steps = [r[1] for r in replies]
            if any(r[2] for r in replies):
                self._stopped = True
                return self._figures(version, steps, True)
            if steps != [version] * len(steps):
                raise RuntimeError(f"tower {self.index}: the shards are at steps {steps}, the coordinator "
                                   f"sent step {version}")
            rep.load([r[0] for r in replies])
            self._loaded = version
        assert isinstance(rep.batches, MemoryBatches)  # in-graph replication: in-memory data (never a sharded source)
        if rep.batches.local_step != version:
            rep.batches.seek(version)
        t0 = time.perf_counter()
        grads = rep.grad_bufs[version % 2]  # (the other set may still be read by the ps)
        if self.buckets is not None:
            self.buckets.begin(grads)
        loss, n = rep.step(grads)
        heads = self.buckets.end() if self.buckets is not None else [None] * len(grads)
        compute_s = time.perf_counter() - t0
        replies = self._wait([
            sh.push_sync(grads[s], self.index, version, loss if s == 0 else None, n if s == 0 else 0, version + 1,
                         **({"head": heads[s]} if heads[s] is not None else {}))
            for s, sh in enumerate(self.shards)])
        steps = [r[1] for r in replies]
        self._stopped = any(r[2] for r in replies)
        self._loaded = None
        if not self._stopped and steps == [version + 1] * len(steps):
            rep.load([r[0] for r in replies])
            self._loaded = version + 1
        return self._figures(version, steps, self._stopped, loss, n, compute_s)


# ------------------------------------------------------------------ the ps side (tasks)


def open_plane(actor_key: str, secret: bytes, host: str, tls: Any, timeout: float) -> tuple[str, int]:
    """A task on shard ``actor_key``'s ps worker: serve the shard over a fresh socket data plane
    with the driver's ``secret`` (a previous driver's listener and connections are closed first:
    its towers can no longer push). Returns (host, port)."""
    worker, shard = _local_shard(actor_key)

    async def reopen() -> tuple[str, int]:
        await shard.close_data_plane()
        return await shard.open_data_plane(secret, host, tls, "float32")

    return sync(worker.loop, reopen, callback_timeout=timeout)


def close_plane(actor_key: str) -> dict[str, int]:
    """A task on shard ``actor_key``'s ps worker: stop serving its data plane."""
    worker, shard = _local_shard(actor_key)
    return sync(worker.loop, shard.close_data_plane, callback_timeout=30)
