"""Any Dask cluster as it comes (issue 20): a ``LocalCluster`` this test starts, with Dask's default
worker names (0, 1, 2, 3) and no resources, runs the digits pipeline through the Python API;
``dtrain plan --scheduler`` shows the automatic assignment. Real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from distributed import Client, LocalCluster

import dtrain
from tests.helpers.paths import PIPELINES, ROOT

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def local_cluster():
    with LocalCluster(n_workers=4, threads_per_worker=1, host="127.0.0.1", dashboard_address=None,
                      processes=True) as cluster, Client(cluster, set_as_default=False) as client:
        yield cluster, client


def test_digits_on_a_local_cluster_with_default_names(local_cluster, tmp_path):
    cluster, client = local_cluster
    names = sorted(str(w["name"]) for w in client.scheduler_info()["workers"].values())
    assert names == ["0", "1", "2", "3"]  # nothing named or tagged for dtrain
    spec = dtrain.load(PIPELINES / "digits_async.yaml")
    result = dtrain.run(spec, client=client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == spec.training.steps
    assert result.summary["eval"]["accuracy"] >= 0.95, result.summary["eval"]
    info = json.loads((tmp_path / "run" / "cluster.json").read_text())
    assert info["assign"] == "auto"
    addresses = [t["address"] for t in info["tasks"].values()]
    assert len(info["tasks"]) == 4 and len(set(addresses)) == 4  # every task its own worker
    assert set(addresses) == set(client.scheduler_info()["workers"])


def test_plan_shows_the_assignment_of_a_running_scheduler(local_cluster):
    cluster, client = local_cluster
    out = subprocess.run([sys.executable, "-m", "dtrain.cli", "plan", str(PIPELINES / "digits_async.yaml"),
                          "--scheduler", cluster.scheduler_address, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    workers = set(client.scheduler_info()["workers"])
    assert plan["assignment"] == "auto" and plan["missing_tasks"] == []
    placed = [s["address"] for s in plan["shards"]] + [r["address"] for r in plan["replicas"]]
    assert set(placed) == workers
    text = subprocess.run([sys.executable, "-m", "dtrain.cli", "plan", str(PIPELINES / "digits_async.yaml"),
                           "--scheduler", cluster.scheduler_address, "--set", "cluster.jobs.worker=4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert text.returncode == 0, text.stderr
    # 4 workers for 2 ps + 4 replicas: both ps tasks share a replica's worker, said in the plan.
    assert "workers assigned automatically" in text.stdout
    assert "sharing a replica's worker: /job:ps/task:0, /job:ps/task:1" in text.stdout
