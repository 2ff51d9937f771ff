"""Elastic replicas on a real cluster that changes size (issue 20): async digits on a
``LocalCluster`` this test scales from 3 workers to 5 and then down to 2 during the run. The two
workers that join take replicas at once; the three that leave take theirs with them, with no
recovery; the run completes every step to the usual accuracy. Real worker processes."""

from __future__ import annotations

import threading
import time

import pytest
from distributed import Client, LocalCluster

import dtrain
from tests.helpers.paths import PIPELINES

pytestmark = pytest.mark.processes

STEPS = 8000


def _wait(cond, run: threading.Thread, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert run.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def test_workers_join_and_leave_an_async_run(tmp_path):
    spec = dtrain.load(PIPELINES / "digits_async.yaml",
                       overrides=["cluster.jobs={ps: 1, worker: {min: 1, max: 4}}", f"training.steps={STEPS}"])
    seen: list[dict] = []
    out: dict = {}
    with LocalCluster(n_workers=3, threads_per_worker=1, host="127.0.0.1", dashboard_address=None,
                      processes=True) as cluster, Client(cluster, set_as_default=False) as client:
        def train() -> None:
            try:
                out["result"] = dtrain.run(spec, client=client, run_dir=tmp_path / "run", progress=seen.append)
            except BaseException as exc:  # reported by the assertions below
                out["error"] = exc

        run = threading.Thread(target=train)
        run.start()
        try:
            _wait(lambda: seen and seen[-1]["step"] >= 200, run, "step 200")
            assert seen[-1]["replicas"] == 2  # 3 workers: the ps task and 2 replicas
            cluster.scale(5)
            _wait(lambda: seen[-1]["replicas"] == 4, run, "4 live replicas")
            joined_at = seen[-1]["step"]
            cluster.scale(2)
            _wait(lambda: seen[-1]["replicas"] == 1, run, "1 live replica")
            left_at = seen[-1]["step"]
        finally:
            run.join(300)
    assert "error" not in out, out.get("error")
    summary = out["result"].summary
    assert left_at < STEPS, "the workers left only after the last step: nothing was elastic"
    assert summary["status"] == "completed" and summary["global_step"] == STEPS
    assert summary["eval"]["accuracy"] >= 0.95, summary["eval"]
    assert (summary["replicas_joined"], summary["replicas_left"], summary["replicas_max"]) == (2, 3, 4)
    assert summary["recoveries"] == 0 and summary["recovery_log"] == []  # a leave is not a loss
    events = summary["elastic_log"]
    assert [e["event"] for e in events] == ["join", "join", "leave", "leave", "leave"]
    assert all(e["step"] <= joined_at for e in events[:2])
    # The steps after the leaves were the last replica's: it went on alone to the end.
    assert seen[-1]["replicas"] == 1 and max(s["step"] for s in seen) == STEPS
