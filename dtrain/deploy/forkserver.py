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
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask

from dtrain.spec.pipeline import PipelineSpec

logger = logging.getLogger(__name__)

METHOD_KEY = "distributed.worker.multiprocessing-method"
# What every worker process imports: the replica's task and the ps actor bring in torch, the model
# builder and the data plane.
PRELOAD = ("torch", "dtrain.worker.tasks", "dtrain.ps.shard")
SIGNALS = "dtrain.deploy.quiet_signals"  # imported first of all, before distributed's list


def preload_for(spec: PipelineSpec) -> list[str]:
    return _preload(str(getattr(spec.data, "source", "") or ""))


def _preload(source: str) -> list[str]:
    """The worker modules, and scikit-learn's datasets for its bundled ones (digits is read
    without it, dtrain.data.sources)."""
    sklearn = source.startswith("sklearn:") and source != "sklearn:digits"
    return [*PRELOAD, "sklearn.datasets"] if sklearn else list(PRELOAD)


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


def warm(spec: PipelineSpec, config: dict[str, Any]) -> bool:
    """Start the forkserver now, preloaded for ``spec`` (``config``: the run's Dask settings, so
    the server gets the nannies' ``pre-spawn-environ``); say whether worker processes will be
    forked from it. Idempotent: a server already running (an earlier run in this process) is kept."""
    if config.get(METHOD_KEY) != "forkserver":
        return False
    return _start(preload_for(spec), config)


def warm_for_file(path: str, overrides: list[str]) -> None:
    """The ``dtrain run`` command's head start: the server begins importing torch while the
    command itself imports it and validates the pipeline. From the file's text alone (no
    validation yet): not for a pipeline that names a scheduler or ``start_method: spawn``; the
    command stops the server as it exits, whatever the run did."""
    import yaml

    from dtrain.deploy.env import DASK_ENV

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeError, yaml.YAMLError, RecursionError):  # (deep nesting: the loader recurses)
        return  # the run reports it, with its line
    if not isinstance(doc, dict):
        return
    cluster_raw, data_raw = doc.get("cluster"), doc.get("data")
    cluster: dict[str, Any] = cluster_raw if isinstance(cluster_raw, dict) else {}
    data: dict[str, Any] = data_raw if isinstance(data_raw, dict) else {}
    if cluster.get("scheduler") or cluster.get("start_method") == "spawn" or any(
            o.startswith(("cluster.scheduler=", "cluster.start_method=spawn")) for o in overrides):
        return
    _start(_preload(str(data.get("source", ""))), {**DASK_ENV, METHOD_KEY: "forkserver"})


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Block the signals the server ignores (quiet_signals.py) in this thread while it is spawned,
    as multiprocessing's resource tracker does for its own: the mask passes through fork and exec,
    so a Ctrl-C to the run's process group while the new interpreter starts and imports (before
    quiet_signals can ignore it) waits there and is discarded once ignored, instead of killing it
    with a traceback. Here, a signal that came meanwhile arrives once the spawn is done."""
    from dtrain.deploy.preload import IGNORED

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _start(preload: list[str], config: dict[str, Any]) -> bool:
    try:
        import multiprocessing
        from multiprocessing import forkserver, resource_tracker, util

        # Python 3.10.0-3.10.8 put the server's socket in Linux's abstract namespace, which any local
        # user can connect to and send it pickles (CVE-2022-42919); this is CPython's own switch
        # back to a 0600 file in a 0700 directory (later versions never use the namespace for it).
        util.abstract_sockets_supported = False  # type: ignore[misc]  # (typeshed marks it Final; CPython documents this)

        from distributed.utils import get_mp_context

        with dask.config.set(config):
            get_mp_context()  # distributed's own preload list (distributed, numpy, ...), set once
            env = {str(k): str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
        server = forkserver._forkserver
        # (private attributes of multiprocessing's ForkServer, which typeshed leaves out)
        if server._forkserver_pid is None:  # type: ignore[attr-defined]
            known = [m for m in server._preload_modules or [] if m != SIGNALS]  # type: ignore[attr-defined]
            multiprocessing.get_context("forkserver").set_forkserver_preload(
                [SIGNALS, *known, *(m for m in preload if m not in known)])
        with _environ(env):
            # (its own spawn unblocks SIGINT and SIGTERM after it, whatever the mask was: first)
            resource_tracker.ensure_running()
            with _signals_held():
                forkserver.ensure_running()
        return True
    except Exception as exc:  # no forkserver on this platform: the nannies spawn as Dask's default
        logger.debug("no forkserver for the worker processes: %s", exc)
        return False


def stop() -> None:
    """End the forkserver this process started, now (the ``dtrain`` command, as it exits). It would
    end by itself once this process has, after its own teardown with torch loaded (about 1 s) while
    holding the command's output streams. SIGKILL: it ignores SIGTERM (quiet_signals.py)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
