"""Shared fixtures: one in-process Dask cluster for the whole session (fast), and helpers to
build small pipelines. Tests that need real worker processes start their own and stop them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import dask
import pytest
from distributed import Client, Scheduler, SpecCluster, Worker

from dtrain.deploy.cluster import HOUSEKEEPING

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "pipelines"

# Every task name any in-process test may ask for.
SHARED_JOBS = {"ps": 3, "worker": 4, "local": 1}


@pytest.fixture(scope="session")
def inproc_client():
    """A real Dask scheduler and real workers named ps-0..2, worker-0..3, local-0, in this process."""
    workers = {}
    for job, n in SHARED_JOBS.items():
        for i in range(n):
            name = f"{job}-{i}"
            workers[name] = {"cls": Worker, "options": {
                "name": name, "nthreads": 2, "resources": {job: 1}, "host": "127.0.0.1", "dashboard": False,
                "memory_limit": "2GiB"}}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False,
                                               "dashboard_address": None}}
    with dask.config.set({"distributed.worker.profile.enabled": False,
                          "distributed.scheduler.work-stealing": False,
                          "distributed.admin.tick.limit": "60s", **HOUSEKEEPING}):
        cluster = SpecCluster(workers=workers, scheduler=scheduler, name="dtrain-tests")
        client = Client(cluster, direct_to_workers=True, set_as_default=False)
        try:
            yield client
        finally:
            client.close()
            cluster.close()


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def pipeline(name: str) -> Path:
    return PIPELINES / name


def _shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("dtrain-")} if os.path.isdir("/dev/shm") else set()


def _tls_dirs() -> set[str]:
    import tempfile

    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("dtrain-tls-")}


def _is_resource_tracker(p) -> bool:
    """multiprocessing's resource tracker, which a LocalCluster's spawned workers start, or its
    forkserver, the embedded cluster's warm parent (dtrain/deploy/forkserver.py): each lives as long
    as this interpreter (it ends when its pipe from here closes) and is no worker."""
    try:
        return any(m in part for part in p.cmdline()
                   for m in ("multiprocessing.resource_tracker", "multiprocessing.forkserver"))
    except Exception:
        return False


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_children():
    """No worker, scheduler or nanny process outlives the suite, and neither does a shared-memory
    file or a temporary TLS directory of the data plane."""
    import psutil

    shm, tls = _shm_files(), _tls_dirs()
    yield
    assert _shm_files() <= shm, f"/dev/shm files left behind: {sorted(_shm_files() - shm)}"
    assert _tls_dirs() <= tls, f"temporary TLS directories left behind: {sorted(_tls_dirs() - tls)}"
    me = psutil.Process(os.getpid())
    alive = [p for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
             and not _is_resource_tracker(p)]
    gone, alive = psutil.wait_procs(alive, timeout=10)
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
    assert threading.active_count() < 200
