"""dtrain deployed across the lab as on separate machines (benchmarks/lab/cluster.py): `dask
scheduler` on one host, a `dtrain worker` per task on its own host, `dtrain run --scheduler` from
a client host; with plain TCP (default run) and TLS (``DTRAIN_LAB_FULL=1``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lab import Lab
from lab.cluster import LabCluster, host_names
from lab.traffic import LinkSampler

pytestmark = pytest.mark.lab

STEPS = 100
TINY = {"name": "lab-tiny", "cluster": {"jobs": {"ps": 1, "worker": 2}},
        "model": {"input_shape": [64], "layers": [{"type": "linear", "out": 128}, {"type": "relu"},
                                                  {"type": "linear", "out": 10}], "loss": "cross_entropy"},
        "data": {"source": "synthetic", "num_samples": 1024, "num_classes": 10, "batch_size": 32},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "training": {"mode": "async", "steps": STEPS, "seed": 0},
        "summary": {"every_steps": 50, "tensorboard": False}}
PARAM_BYTES = 4 * (64 * 128 + 128 + 128 * 10 + 10)


def _train_and_check(lab: Lab, cluster: LabCluster, tmp_path: Path, tls: bool) -> None:
    have = cluster.workers()
    scheme = "tls" if tls else "tcp"
    for name, host in (("ps-0", "ps0"), ("worker-0", "worker0"), ("worker-1", "worker1")):  # each on its host
        assert have[name]["address"].startswith(f"{scheme}://{lab[host].address}:"), have
    with LinkSampler(lab) as sampler:
        before = sampler.read()
        rc, summary = cluster.run_to_end(TINY, tmp_path / "run", timeout=180)
        after = sampler.read()
    assert rc == 0, cluster.log("run")
    assert summary is not None and summary["status"] == "completed" and summary["global_step"] == STEPS, summary
    # A socket per replica, none of them through shared memory: the hosts' /dev/shm are private.
    dp = summary["data_plane"]
    assert dp["transport"] == "socket" and dp["connections"] >= 1, dp
    assert dp["shared_memory_connections"] == 0 and dp["in_place_connections"] == 0, dp
    # Every gradient crossed its worker's link out and ps0's link in, every parameter reply the
    # other way (counters: bytes out of a host, bytes into it).
    moved = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
    done = {int(i): r["steps"] for i, r in summary["replicas_stats"].items()}
    assert sum(done.values()) >= STEPS, done  # (async: a push in flight at the end may count too)
    for i, n in done.items():
        assert moved[f"worker{i}"][0] >= n * PARAM_BYTES and moved[f"worker{i}"][1] >= n * PARAM_BYTES, (moved, done)
    assert moved["ps0"][1] >= STEPS * PARAM_BYTES and moved["ps0"][0] >= STEPS * PARAM_BYTES, moved


@pytest.mark.timeout(240)
def test_a_run_across_the_lab_crosses_the_links_and_no_shared_memory(lab_cluster, tmp_path):
    _train_and_check(*lab_cluster, tmp_path, tls=False)


@pytest.mark.lab_full
@pytest.mark.timeout(240)
def test_a_tls_run_across_the_lab_crosses_the_links_and_no_shared_memory(tmp_path):
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]
    with Lab(host_names(tasks), rate="1gbit") as lab:
        with LabCluster(lab, tasks, tmp_path / "cluster", tls=True) as cluster:
            _train_and_check(lab, cluster, tmp_path, tls=True)
    assert lab.leftovers() == []
