"""The Dask tasks of a pipeline replica's stages (``dtrain.worker.stages`` has the loop).

Before the stage tasks start, the chief runs :func:`open_stage_listener` on the worker of every
stage but the first: it opens the listening socket the upstream stage connects to and keeps it
in this process (the stage task that runs here next takes it by key), and returns its address.
:func:`stage_task` then runs one stage: it accepts its upstream link, connects its downstream
one, opens its own shards' data-plane connections once its model is built, and trains.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict
from typing import Any

from distributed import get_worker, secede

from dtrain.dataplane.links import StageListener, connect
from dtrain.plan.assign import task_host
from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

from .stages import link_shape, run_stage, stage_shards
from .tasks import own_tls, partition_reader, shard_handles, socket_handles

_LISTENERS: dict[str, StageListener] = {}
_LOCK = threading.Lock()
UNCLAIMED_S = 900.0  # a listener no stage task took (its run died first) is closed after this


def open_stage_listener(key: str, secret: bytes, tls: bool, shm: tuple[int, int] | None = None) -> tuple[str, int]:
    """Listen for the upstream stage on this worker's host; the stage task ``key`` takes it.
    ``shm``: the link's shared-memory shape (``stages.link_shape``), accepted when offered."""
    from dtrain.dataplane.protocol import server_ssl_context

    ctx = server_ssl_context(own_tls()) if tls else None
    listener = StageListener(task_host(get_worker().address), secret, ctx, shm)
    with _LOCK:
        now = time.monotonic()
        for k in [k for k, v in _LISTENERS.items() if now - v.created > UNCLAIMED_S]:
            _LISTENERS.pop(k).close()
        _LISTENERS[key] = listener
    return listener.host, listener.port


def stage_task(spec: PipelineSpec, plan: Plan, index: int, position: int, refs: list[tuple[str, str]],
               start_local_step: int, data_plane: dict[str, Any] | None, links: dict[str, Any],
               attempt: int = 0) -> dict[str, Any]:
    """Stage ``position`` of pipeline replica ``index``: trains until the pipeline stops, returns
    its counters. ``links``: the secret, TLS flag, and each later stage's listener key and address."""
    from dtrain.dataplane.protocol import client_ssl_context

    secede()
    t = spec.training
    timeout = t.call_timeout_s + t.barrier_timeout_s
    start = max(t.stage_start_timeout_s, timeout)  # each link's first message: the neighbour's start
    name = f"replica {index} stage {position - 1}->{position}"
    up = down = None
    try:
        if position > 0:
            with _LOCK:
                listener = _LISTENERS.pop(links["keys"][position])
            up = listener.accept(name, timeout, start)
        if position + 1 < plan.stage_positions:
            host, port = links["endpoints"][position + 1]
            ctx = client_ssl_context(own_tls()) if links.get("tls") else None
            down = connect(host, port, links["secret"], f"replica {index} stage {position}->{position + 1}",
                           timeout, ctx, link_shape(spec, plan, position), start)
    except BaseException:
        for link in (up, down):
            if link is not None:
                link.close()
        raise
    mine = stage_shards(plan, position)
    opened: list[Any] = []

    def open_handles() -> list[Any]:
        opened.extend(socket_handles(spec, plan, index, data_plane, attempt, only=mine))  # type: ignore[arg-type]
        return opened

    shards = open_handles if data_plane else shard_handles([refs[i] for i in mine])
    try:
        stats = run_stage(spec, plan, index, position, shards, up, down, start_local_step,
                          read=partition_reader(plan) if position == 0 else None, owns_replies=bool(data_plane))
    finally:
        for s in opened:
            s.close()
    out = asdict(stats)
    out["worker"] = get_worker().name
    out["pid"] = os.getpid()
    return out
