"""Functions that run inside Dask tasks on the cluster's workers.

The replica task rebuilds its ps handles from ``(address, key)`` pairs instead of receiving
Actor objects: a task that receives an actor depends on the actor's key and is failed by the
scheduler the moment that ps dies, whereas a rebuilt handle lets the replica notice (its calls
time out) and lets the session recover. It also leaves its thread
slot (``secede``) so a long training loop does not starve other tasks on that worker.

In-graph replication's tasks (below the replica task) are what the step graphs built by the
chief's driver (``dtrain.chief.ingraph``) run: ``read_shard`` and ``reduce_apply`` pinned to a ps
worker (they find the shard actor in their worker's state and run its coroutine on that worker's
event loop, so no actor call crosses the network), ``replica_gradients`` pinned to worker task
``r`` (its model, buffers and data iterator cached in the process across steps), ``release``;
for in-graph async (``dtrain.chief.ingraph_async``) ``tower_gradients`` and ``tower_push`` (the
shard applies one tower's gradient at once, ``WorkerShard.push_counted``). In-graph sync on the
socket data plane runs none of these per step: its towers live in ``ingraph_tower_actor``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from distributed import get_worker, secede
from distributed.actor import Actor
from distributed.utils import sync

from dtrain.plan.job import ReplicaJob
from dtrain.ps.shard import ParameterShard

from .inputs import MemoryBatches
from .replica import ReplicaModel, model_buffers, run_replica

logger = logging.getLogger(__name__)


def shard_handles(refs: list[tuple[str, str]], attempt: int | None = None) -> list[Any]:
    """Actor handles for ``(worker address, actor key)`` pairs, bound to this worker. ``attempt``:
    this submission of the replica, sent with each push (the shard refuses other attempts')."""
    worker = get_worker()
    actors = [Actor(ParameterShard, address, key, worker=worker) for address, key in refs]
    return actors if attempt is None else [AttemptShard(a, attempt) for a in actors]


class AttemptShard:
    """A shard actor handle whose pushes carry the replica's ``attempt`` (``ParameterShard.set_owner``:
    a push from an attempt the session replaced is refused, FencedOff); other calls as the actor's."""

    def __init__(self, actor: Actor, attempt: int):
        self._actor, self.attempt = actor, attempt

    def push_pull(self, *args: Any, **kwargs: Any) -> Any:
        return self._actor.push_pull(*args, attempt=self.attempt, **kwargs)

    def push_sync(self, *args: Any, **kwargs: Any) -> Any:
        return self._actor.push_sync(*args, attempt=self.attempt, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)


def tls_pems(security: Any) -> dict[str, str | None] | None:
    """A worker's own TLS (its ``distributed.Security``: ``dtrain worker --tls-*``, or the embedded
    cluster's per-run certificate) as PEM texts for the data plane; None when it has none. Each
    process uses its own certificate and key: no private key travels through Dask (review M2)."""
    from pathlib import Path

    cfg = security.get_tls_config_for_role("worker") if security is not None else {}
    if not (cfg.get("ca_file") and cfg.get("cert")):
        return None

    def pem(value: str | None) -> str | None:  # Security holds file names, or the texts (temporary())
        return None if not value else value if "-----BEGIN" in value else Path(value).read_text()

    return {"ca": pem(cfg["ca_file"]), "cert": pem(cfg["cert"]), "key": pem(cfg.get("key"))}


def own_tls() -> dict[str, str | None]:
    """This worker's TLS for a data plane the chief asked to encrypt (RuntimeError without one)."""
    worker = get_worker()
    tls = tls_pems(worker.security)
    if tls is None:
        raise RuntimeError(f"worker {worker.name} has no TLS certificate, but the cluster uses TLS: start it "
                           f"with --tls-ca-file, --tls-cert and --tls-key (docs/deployment.md#tls)")
    return tls


class WorkerShard(ParameterShard):
    """The ParameterShard actor as the chief creates it: a data plane asked for TLS (``tls=True``)
    serves with this worker's own certificate (``own_tls``), so ps/ needs no Dask."""

    def __init__(self, config: dict[str, Any], init: torch.Tensor):
        super().__init__(config, init)
        self._tls = own_tls() if config.get("tls") else None  # read here: get_worker() is this task's

    async def open_data_plane(self, secret: bytes, host: str = "127.0.0.1", tls: Any = None,
                              wire_dtype: str = "float32", share_params: bool = False) -> tuple[str, int]:
        return await super().open_data_plane(secret, host, self._tls if tls is True else tls, wire_dtype,
                                             share_params)

    async def push_counted(self, grad: torch.Tensor, replica: int, version: int, loss: float | None, samples: int,
                           local_step: int, out: torch.Tensor) -> bool:
        """In-graph async (``tower_push``): ``push_pull``, and whether this push was applied. A
        checkpoint hold is waited out first: from there to its apply ``push_pull`` never yields to
        the event loop, so the step moves by one exactly when this push was applied."""
        await self._wait_unheld()
        before = self.step
        await self.push_pull(grad, replica, version, loss, samples, local_step, out=out)
        return self.step > before


def socket_handles(job: ReplicaJob, data_plane: dict[str, Any], attempt: int = 0) -> list[Any]:
    """Socket data-plane handles (``training.transport: socket``), one per shard of the job (a
    pipeline stage's: its own), each connecting to that shard's endpoint in ``data_plane`` (TLS
    with this worker's own certificate when the chief asks for it: ``tls`` True). ``attempt``:
    this submission of the replica (the ps refuses pushes from its other attempts)."""
    from dtrain.dataplane.client import SocketShard
    from dtrain.dataplane.protocol import client_ssl_context

    tls = data_plane.get("tls")
    if tls is True:
        tls = own_tls()
    ctx = client_ssl_context(tls) if tls else None
    timeout = job.settings.call_timeout_s + job.settings.barrier_timeout_s
    endpoints = data_plane["endpoints"]  # each shard's (host, port), in plan order
    return [SocketShard(host, port, data_plane["secret"], job.index, s.numel, timeout=timeout, ssl_context=ctx,
                        wire_dtype=data_plane.get("wire_dtype", "float32"),
                        shared_memory=data_plane.get("shared_memory", True), attempt=attempt,
                        in_place_views=job.model.module is None, tables=dict(s.tables))
            for s in job.shards for host, port in [endpoints[s.index]]]


REPLICA_TOPIC = "dtrain-replica"  # a replica's counters, for the chief (docs/observability.md)


def reporter(job: ReplicaJob, attempt: int, run_id: str | None = None) -> Any:
    """A replica's telemetry: its counters as an event on ``REPLICA_TOPIC`` (the worker's batched
    stream to the scheduler, thread-safe; no round trip), which the chief subscribes to. Tagged
    with the run's id, so a chief never counts another run's replicas of the same name."""
    if not job.settings.telemetry:
        return None
    worker = get_worker()
    tag = {"run": run_id or job.name, "attempt": attempt, "worker": str(worker.name)}
    return lambda counters: worker.log_event(REPLICA_TOPIC, {**tag, **counters})


def replica_task(job: ReplicaJob, refs: list[tuple[str, str]], start_local_step: int = 0,
                 data_plane: dict[str, Any] | None = None, local_rank: int | None = None, attempt: int = 0,
                 run_id: str | None = None) -> dict[str, Any]:
    """One long-running replica (``job``: what it trains, on which slice of the data, with which
    shards): trains until the ps says stop, returns its counters. ``refs``: every shard's
    ``(worker address, actor key)``, in plan order.

    With ``data_plane`` (endpoints, secret, tls) the flat buffers travel over the socket data
    plane, its connections opened once the model is built and the data loaded, under
    ``attempt`` (the session's submission of this replica, for fencing); otherwise over ps
    actor calls."""
    secede()
    opened: list[Any] = []

    def open_handles() -> list[Any]:
        # Called by run_replica once its model is built and its data loaded: a connection opened
        # before would sit idle through that (the ps used to drop it after about 2 minutes).
        assert data_plane is not None  # (only with a data plane)
        opened.extend(socket_handles(job, data_plane, attempt))
        return opened

    shards = open_handles if data_plane else shard_handles([refs[s.index] for s in job.shards], attempt)
    try:
        stats = run_replica(job, shards, start_local_step=start_local_step, owns_replies=bool(data_plane),
                            local_rank=local_rank, read=partition_reader(job), report=reporter(job, attempt, run_id),
                            abandoned=abandoned())
    finally:
        for s in opened:
            close = getattr(s, "close", None)
            if close is not None:
                close()
    out = asdict(stats)
    out["worker"] = get_worker().name
    out["pid"] = os.getpid()
    return out



def abandoned() -> Callable[[], bool]:
    """In a task: whether the scheduler no longer wants it. Its client (the chief) left the
    scheduler, or cancelled it: the scheduler releases the task and its worker marks it cancelled,
    though its thread runs on. A local look at the worker's state, cheap enough for every step."""
    worker = get_worker()
    key, tasks = worker.get_current_task(), worker.state.tasks

    def gone() -> bool:
        ts = tasks.get(key)
        return ts is None or ts.state == "cancelled"

    return gone


def partition_reader(job: ReplicaJob) -> Any:
    """For a Dask collection's partitions (``dtrain.run(spec, data=...)``): a reader that computes
    one partition at a time on this worker (its readers' threads call it); None for files or
    data in memory."""
    stream = job.data.stream if job.data is not None else None
    if stream is None or stream.format != "dask":
        return None
    import cloudpickle
    from distributed import get_client

    graphs = cloudpickle.loads(stream.partitions)
    client, here = get_client(), get_worker().address  # taken in the task's thread, used by the readers

    def read(shard: Any) -> Any:
        future = client.compute(graphs[shard.part], workers=[here], allow_other_workers=True)
        try:
            return future.result()
        finally:
            future.release()

    return read


# ------------------------------------------------------------------------- in-graph replication

# Per-process state of the tasks, keyed by (run token, replica or shard index). The gradient
# tasks of one replica always run on the same worker, so its model persists between steps.
_MODELS: dict[tuple[str, int], ReplicaModel] = {}
_SUMS: dict[tuple[str, int], torch.Tensor] = {}
_LOCK = threading.Lock()



def _local_shard(actor_key: str) -> tuple[Any, Any]:
    worker = get_worker()
    shard = worker.state.actors.get(actor_key)
    if shard is None:
        raise RuntimeError(f"worker {worker.name} ({worker.address}) holds no ps shard {actor_key!r}; "
                           "was its ps task restarted?")
    return worker, shard


def shard_state(actor_key: str) -> tuple[int, bool]:
    """(step, stopped) of the shard actor living on this worker."""
    _, shard = _local_shard(actor_key)
    return shard.step, bool(shard.stop or shard.error is not None)


def read_shard(actor_key: str, timeout: float, *after: Any, fresh: bool = False) -> tuple[torch.Tensor, int, bool]:
    """The shard's parameters (a snapshot buffer), its step and its stop flag. ``after`` are the
    tasks this read must follow (the shard's previous apply); their values are unused. ``fresh``:
    into a new tensor, not the shard's ring of reply buffers (async towers read at any pace, so a
    ring slot could be refilled before a slow tower has loaded it)."""
    worker, shard = _local_shard(actor_key)
    out = torch.empty_like(shard.param) if fresh else None
    params, step, stop, _generation = sync(worker.loop, shard.pull, 0, out, callback_timeout=timeout)
    return params, step, stop


def _replica_model(job: ReplicaJob, token: str) -> ReplicaModel:
    with _LOCK:
        rep = _MODELS.get((token, job.index))
    if rep is None:
        rep = ReplicaModel(job)
        with _LOCK:
            _MODELS[(token, job.index)] = rep
    return rep


def _scratch(token: str, shard: int, like: torch.Tensor) -> torch.Tensor:
    """This process's buffer of ``like``'s shape for a run's ``shard`` (kept across steps; ``release``
    drops it)."""
    with _LOCK:
        buf = _SUMS.get((token, shard))
        if buf is None or buf.shape != like.shape:
            buf = _SUMS[(token, shard)] = torch.empty_like(like)
    return buf


def _gradients(rep: ReplicaModel, local_step: int, reads: tuple[tuple[torch.Tensor, int, bool], ...]
               ) -> dict[str, Any]:
    """``rep``'s gradient on its ``local_step``-th batch (its data order put there first: a restored
    checkpoint's place), on the parameters it read."""
    assert isinstance(rep.batches, MemoryBatches)  # in-graph replication: in-memory data (never a sharded source)
    if rep.batches.local_step != local_step:
        rep.batches.seek(local_step)
    t0 = time.perf_counter()
    rep.load([r[0] for r in reads])
    # Two alternating buffer sets: this step's result may still be referenced by Dask while the
    # next step fills the other one (step v+2 starts only after step v's transfers are done).
    grads = rep.grad_bufs[local_step % 2]
    loss, n = rep.step(grads)
    return {"grads": grads, "loss": loss, "samples": n, "compute_s": time.perf_counter() - t0,
            "device": str(rep.device)}


def replica_gradients(job: ReplicaJob, token: str, *reads: tuple[torch.Tensor, int, bool]) -> dict[str, Any]:
    """Replica ``job.index``'s gradient on the parameters of one step (one flat buffer per shard)."""
    steps = sorted({r[1] for r in reads})
    if len(steps) != 1:
        raise RuntimeError(f"replica {job.index}: the shards' parameters are of different steps {steps}; "
                           "a replica never mixes steps")
    version = steps[0]
    # Every replica contributes to every step: its local step is the global step.
    return {**_gradients(_replica_model(job, token), version, reads), "step": version}


def reduce_apply(actor_key: str, token: str, shard: int, timeout: float, read: tuple[torch.Tensor, int, bool],
                 *results: dict[str, Any]) -> dict[str, Any]:
    """Sum the replicas' gradients for ``shard`` and apply their mean through the local actor."""
    worker, ps = _local_shard(actor_key)
    version = read[1]
    first = results[0]["grads"][shard]
    total = _scratch(token, shard, first)
    total.copy_(first)
    for res in results[1:]:
        total.add_(res["grads"][shard])
    losses = [res["loss"] for res in results]
    samples = sum(res["samples"] for res in results)
    step = sync(worker.loop, ps.apply_mean, total, len(results), version, sum(losses) / len(losses), samples,
                callback_timeout=timeout)
    out: dict[str, Any] = {"shard": shard, "version": version, "step": step,
                           "stop": bool(ps.stop or ps.error is not None)}
    if shard == 0:
        out["replicas"] = [{"loss": r["loss"], "samples": r["samples"], "compute_s": r["compute_s"],
                            "device": r["device"]} for r in results]
    return out


def tower_gradients(job: ReplicaJob, token: str, local_step: int, *reads: tuple[torch.Tensor, int, bool]
                    ) -> dict[str, Any]:
    """In-graph async: tower ``job.index``'s gradient on its ``local_step``-th batch, on the parameters
    it read. Unlike :func:`replica_gradients` the shards' steps may differ (each applies pushes as
    they arrive, as between-graph async replicas' pulls see them)."""
    return {**_gradients(_replica_model(job, token), local_step, reads), "local_step": local_step,
            "versions": [r[1] for r in reads]}


def tower_push(actor_key: str, token: str, shard: int, replica: int, timeout: float,
               result: dict[str, Any]) -> dict[str, Any]:
    """In-graph async: push tower ``replica``'s gradient for ``shard`` through the local actor,
    applied at once (``push_pull``: no averaging, no barrier). The gradient's version is the step
    of the parameters the tower read from this shard, so the shard counts its staleness."""
    worker, ps = _local_shard(actor_key)
    out = _scratch(token, shard, ps.param)  # the reply's copy lands here: the tower reads afresh each step
    applied = sync(worker.loop, ps.push_counted, result["grads"][shard], replica, result["versions"][shard],
                   result["loss"], result["samples"], result["local_step"] + 1, out, callback_timeout=timeout)
    out_ = {"shard": shard, "step": ps.step, "applied": bool(applied), "stop": bool(ps.stop or ps.error is not None)}
    if shard == 0:
        out_.update({k: result[k] for k in ("loss", "samples", "compute_s", "device", "local_step")})
    return out_


def release(token: str, replica: int | None = None, shard: int | None = None) -> dict[str, Any]:
    """Drop this process's cached model (``replica``) or sum buffer (``shard``) of a run; for a
    replica, return what its stats need (replica 0 also returns the model's non-parameter buffers)."""
    worker = get_worker()
    out: dict[str, Any] = {"worker": worker.name, "pid": os.getpid()}
    with _LOCK:
        rep = _MODELS.pop((token, replica), None) if replica is not None else None
        if shard is not None:
            _SUMS.pop((token, shard), None)
    if rep is not None:
        out["device"] = str(rep.device)
        if replica == 0:
            out["buffers"] = model_buffers(rep.model)
    return out
