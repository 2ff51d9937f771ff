"""A warm parent for the embedded cluster's worker processes: a forkserver with torch and dtrain's
worker modules already imported.

Dask's nannies start worker processes with ``spawn`` by default: every one is a fresh Python that
imports distributed, then torch, then dtrain's ps or replica modules when its first task arrives,
about 2 s of CPU each, all at once (four on two cores for the digits pipeline). With
``multiprocessing-method: forkserver`` they are forked from one server process that imported
those modules once, and the server is started as soon as the run knows it will start an embedded
cluster, so it imports them while the chief validates the data and compiles the plan.

The server inherits the environment at its start, and what glibc and OpenMP read there applies to
every process forked from it: so it starts with the nannies' own ``pre-spawn-environ`` (dtrain's
malloc thresholds, one OpenMP thread), as a spawned worker would get. Each worker's own settings
(``torch_threads``) are applied in the worker, as before. Nothing changes for a cluster of one's
own (``dtrain worker``, ``--scheduler``, ``client=``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import dask

logger = logging.getLogger(__name__)

METHOD_KEY = "distributed.worker.multiprocessing-method"
# What every worker process imports (the replica's task and the ps actor bring in torch, the model
# builder, the data plane); the data sources' heavy imports only where the pipeline uses them.
PRELOAD = ("torch", "dtrain.worker.tasks", "dtrain.ps.shard")


def preload_for(spec: Any) -> list[str]:
    mods = list(PRELOAD)
    if str(getattr(spec.data, "source", "") or "").startswith("sklearn:"):
        mods.append("sklearn.datasets")
    return mods


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def warm(spec: Any, config: dict[str, Any]) -> bool:
    """Start the forkserver now, preloaded for ``spec`` (``config``: the run's Dask settings, so
    the server gets the nannies' ``pre-spawn-environ``); say whether worker processes will be
    forked from it. Idempotent: a server already running (an earlier run in this process) is kept."""
    if config.get(METHOD_KEY) != "forkserver":
        return False
    try:
        import multiprocessing
        from multiprocessing import forkserver

        from distributed.utils import get_mp_context

        with dask.config.set(config):
            get_mp_context()  # distributed's own preload list (distributed, numpy, ...), set once
            env = {str(k): str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
        server = forkserver._forkserver
        if server._forkserver_pid is None:
            known = list(server._preload_modules or [])
            multiprocessing.get_context("forkserver").set_forkserver_preload(
                known + [m for m in preload_for(spec) if m not in known])
        with _environ(env):
            forkserver.ensure_running()
        return True
    except Exception as exc:  # no forkserver on this platform: the nannies spawn as Dask's default
        logger.debug("no forkserver for the worker processes: %s", exc)
        return False
