"""The lab tests need root and Linux namespaces; they skip with the reason where either is missing.
The heavier ones (a TLS deployment, network faults) also need ``DTRAIN_LAB_FULL=1`` (docs/lab.md)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # `lab`, as benchmarks/lab_bench.py imports it

from lab import probe  # noqa: E402

WHY_NOT = probe()
FULL = os.environ.get("DTRAIN_LAB_FULL") == "1"


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            # One xdist worker runs every lab test (`make test` runs the suite on two): they share the
            # package's lab cluster, and two labs at once would compete for the machine's namespaces.
            item.add_marker(pytest.mark.xdist_group("lab"))
        if item.get_closest_marker("lab") is None:
            continue
        if WHY_NOT:
            item.add_marker(pytest.mark.skip(reason=f"network lab unavailable: {WHY_NOT}"))
        elif item.get_closest_marker("lab_full") and not FULL:
            item.add_marker(pytest.mark.skip(reason="a heavier lab test: set DTRAIN_LAB_FULL=1 to run it"))


TASKS = [("ps", 0), ("worker", 0), ("worker", 1)]


@pytest.fixture(scope="package")
def lab_cluster(tmp_path_factory):
    """One lab (scheduler, client, ps0, worker0, worker1 at 1 Gbit/s) with a plain-TCP dtrain
    deployment, shared by the default-run tests that train (a cluster start is ~9 s on 2 cores);
    a test that changes a link puts it back. Checked to leave nothing behind."""
    from lab import Lab
    from lab.cluster import LabCluster, host_names

    with Lab(host_names(TASKS), rate="1gbit") as lab:
        with LabCluster(lab, TASKS, tmp_path_factory.mktemp("lab-cluster")) as cluster:
            yield lab, cluster
    assert lab.leftovers() == []
