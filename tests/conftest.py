"""Shared fixtures: one in-process Dask cluster for the whole session (fast), and helpers to
build small pipelines. Tests that need real worker processes start their own and stop them.
The leak check that runs after every test is tests/helpers/leaks.py."""

from __future__ import annotations

from pathlib import Path

import dask
import pytest
from distributed import Client, Scheduler, SpecCluster, Worker

from dtrain.deploy.cluster import HOUSEKEEPING

pytest_plugins = ["tests.helpers.leaks"]

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
