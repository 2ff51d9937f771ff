"""Functions that run inside Dask tasks on the cluster's workers.

The replica task rebuilds its ps handles from ``(address, key)`` pairs instead of receiving
Actor objects: a task that receives an actor depends on the actor's key and is failed by the
scheduler the moment that ps dies, whereas a rebuilt handle lets the replica notice (its calls
time out) and lets the session recover (../shared/dask-notes.md §4). It also leaves its thread
slot (``secede``) so a long training loop does not starve other tasks on that worker.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

from distributed import get_worker, secede
from distributed.actor import Actor

from dtrain.ps.shard import ParameterShard

from .replica import run_replica

logger = logging.getLogger(__name__)


def shard_handles(refs: list[tuple[str, str]]) -> list[Actor]:
    """Actor handles for ``(worker address, actor key)`` pairs, bound to this worker."""
    worker = get_worker()
    return [Actor(ParameterShard, address, key, worker=worker) for address, key in refs]


def socket_handles(spec: Any, plan: Any, index: int, data_plane: dict[str, Any]) -> list[Any]:
    """Socket data-plane handles (``training.transport: socket``), one per shard."""
    from dtrain.dataplane.server import SocketShard, client_ssl_context

    tls = data_plane.get("tls")
    ctx = client_ssl_context(tls) if tls else None
    timeout = spec.training.call_timeout_s + spec.training.barrier_timeout_s
    return [SocketShard(host, port, data_plane["secret"], index, s.numel, timeout=timeout, ssl_context=ctx,
                        wire_dtype=data_plane.get("wire_dtype", "float32"),
                        shared_memory=data_plane.get("shared_memory", True))
            for (host, port), s in zip(data_plane["endpoints"], plan.shards, strict=True)]


def replica_task(spec: Any, plan: Any, index: int, refs: list[tuple[str, str]],
                 start_local_step: int = 0, data_plane: dict[str, Any] | None = None,
                 local_rank: int | None = None) -> dict[str, Any]:
    """One long-running replica: trains until the ps says stop, returns its counters.

    With ``data_plane`` (endpoints, secret, tls) the flat buffers travel over the socket data
    plane; otherwise over ps actor calls."""
    secede()
    shards = socket_handles(spec, plan, index, data_plane) if data_plane else shard_handles(refs)
    try:
        stats = run_replica(spec, plan, index, shards, start_local_step=start_local_step,
                            owns_replies=bool(data_plane), local_rank=local_rank)
    finally:
        for s in shards:
            close = getattr(s, "close", None)
            if close is not None:
                close()
    out = asdict(stats)
    out["worker"] = get_worker().name
    out["pid"] = os.getpid()
    return out


def worker_pid() -> int:
    """The worker process id (used by fault tests and by `dtrain plan` against a live cluster)."""
    return os.getpid()
