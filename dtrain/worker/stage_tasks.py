"""The Dask tasks of a pipeline replica's stages (``dtrain.worker.stages`` has the loop).

Before the stage tasks start, the chief runs :func:`open_stage_listener` on the worker of every
stage but the first: it opens the listening socket the upstream stage connects to and keeps it
in this process (the stage task that runs here next takes it by key; one that no task takes, as
when its run failed first, is closed after ``UNCLAIMED_S``), and returns its address.
:func:`stage_task` then runs one stage: it accepts its upstream link, connects its downstream
one, opens its own shards' data-plane connections once its model is built, and trains.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict
from typing import Any

from distributed import get_worker, secede

from dtrain.dataplane.links import StageListener, connect
from dtrain.dataplane.protocol import DataPlaneError
from dtrain.plan.assign import task_host
from dtrain.plan.job import ReplicaJob

from .stages import run_stage
from .tasks import abandoned, own_tls, partition_reader, shard_handles, socket_handles

logger = logging.getLogger(__name__)

_LISTENERS: dict[str, tuple[StageListener, threading.Timer]] = {}  # key -> the listener, its expiry
_LOCK = threading.Lock()
UNCLAIMED_S = 900.0  # a listener no stage task took (its run died first) is closed after this


def open_stage_listener(key: str, secret: bytes, tls: bool, shm: tuple[int, int] | None = None) -> tuple[str, int]:
    """Listen for the upstream stage on this worker's host; the stage task ``key`` takes it.
    ``shm``: the link's shared-memory shape (``stages.link_shape``), accepted when offered."""
    from dtrain.dataplane.protocol import server_ssl_context

    ctx = server_ssl_context(own_tls()) if tls else None
    listener = StageListener(task_host(get_worker().address), secret, ctx, shm)
    expiry = threading.Timer(UNCLAIMED_S, _expire, args=(key, listener))
    expiry.daemon = True
    expiry.name = f"dtrain-listener-expiry-{key}"
    with _LOCK:
        _LISTENERS[key] = (listener, expiry)
    expiry.start()
    return listener.host, listener.port


def _expire(key: str, listener: StageListener) -> None:
    """Close ``listener`` if no stage task took it (its run ended or failed first)."""
    with _LOCK:
        if _LISTENERS.get(key, (None,))[0] is not listener:
            return
        del _LISTENERS[key]
    listener.close()
    logger.info("closed the stage listener %s: no stage task took it in %g s", key, UNCLAIMED_S)


def _claim(key: str, name: str) -> StageListener:
    """The listener ``key`` opened for this stage task (its expiry cancelled)."""
    with _LOCK:
        entry = _LISTENERS.pop(key, None)
    if entry is None:
        raise DataPlaneError(f"stage link {name}: no listener {key} on this worker (closed after {UNCLAIMED_S:g} s "
                             "unclaimed, or the worker restarted)")
    entry[1].cancel()
    return entry[0]


def stage_task(job: ReplicaJob, refs: list[tuple[str, str]], start_local_step: int,
               data_plane: dict[str, Any] | None, links: dict[str, Any], attempt: int = 0) -> dict[str, Any]:
    """The job's stage (``job.stage.position`` of pipeline replica ``job.index``): trains until
    the pipeline stops, returns its counters. ``refs``: every shard's ``(worker address, actor
    key)``, in plan order (the stage takes its own); ``links``: the secret, TLS flag, and each
    later stage's listener key and address."""
    from dtrain.dataplane.protocol import client_ssl_context

    assert job.stage is not None  # a stage task's job
    secede()
    index, position = job.index, job.stage.position
    t = job.settings
    timeout = t.call_timeout_s + t.barrier_timeout_s
    start = max(t.stage_start_timeout_s, timeout)  # each link's first message: the neighbour's start
    name = f"replica {index} stage {position - 1}->{position}"
    up = down = None
    try:
        if position > 0:
            up = _claim(links["keys"][position], name).accept(name, timeout, start)
        if position + 1 < job.stage.positions:
            host, port = links["endpoints"][position + 1]
            ctx = client_ssl_context(own_tls()) if links.get("tls") else None
            down = connect(host, port, links["secret"], f"replica {index} stage {position}->{position + 1}",
                           timeout, ctx, job.stage.link, start)
    except BaseException:
        for link in (up, down):
            if link is not None:
                link.close()
        raise
    opened: list[Any] = []

    def open_handles() -> list[Any]:
        opened.extend(socket_handles(job, data_plane, attempt))  # type: ignore[arg-type]
        return opened

    shards = open_handles if data_plane else shard_handles([refs[s.index] for s in job.shards], attempt)
    try:
        stats = run_stage(job, shards, up, down, start_local_step, read=partition_reader(job),
                          owns_replies=bool(data_plane), abandoned=abandoned())  # (a later stage reads no data: no reader)
    finally:
        for s in opened:
            s.close()
    out = asdict(stats)
    out["worker"] = get_worker().name
    out["pid"] = os.getpid()
    return out
