"""The scheduler's endpoints during a real run on the embedded cluster: its Prometheus
``/metrics`` carries dtrain's series for every replica and shard, and the dashboard's ``/dtrain``
page answers with its plots. A hook in the run (tests.helpers.observe.ScrapeHook) scrapes them
over HTTP while the replicas train."""

from __future__ import annotations

import json
import re

import pytest

import dtrain

pytestmark = pytest.mark.slow  # 1,200 steps of a slowed model, scraped as it trains


def test_metrics_and_dashboard_page_during_a_run(tmp_path):
    scrapes = tmp_path / "scrapes.json"
    spec = dtrain.loads(f"""
name: live
cluster: {{jobs: {{ps: 2, worker: 2}}}}
model: {{module: "tests.helpers.slowmodels:SlowMLP", kwargs: {{delay_s: 0.004, slow_worker: none,
        fast_delay_s: 0.004}}}}
data: {{source: sklearn:digits, batch_size: 32}}
optimizer: {{name: sgd, lr: 0.05}}
training: {{mode: async, steps: 1200}}
summary: {{every_steps: 20, tensorboard: false}}
checkpoint: {{every_steps: 400, keep: 2}}
eval: {{every_steps: 400}}
observe: {{interval_s: 0.2}}
hooks: [{{type: "tests.helpers.observe:ScrapeHook", args: {{path: {str(scrapes)!r}}}}}]
""")
    result = dtrain.run(spec, run_dir=tmp_path / "run", processes=False)
    assert result.summary["status"] == "completed"
    taken = json.loads(scrapes.read_text())
    assert taken, "no scrape of /metrics during the run carried dtrain series"
    # The last scrape during the run: a series per replica and per shard, labelled by job and task.
    text = taken[-1]["metrics"]
    for i in range(2):
        assert re.search(rf'dtrain_replica_steps_total\{{[^}}]*job="worker"[^}}]*replica="{i}"[^}}]*\}} [1-9]', text) \
            or re.search(rf'dtrain_replica_steps_total\{{[^}}]*replica="{i}"[^}}]*job="worker"[^}}]*\}} [1-9]', text), text
        assert re.search(rf'dtrain_replica_seconds_total\{{[^}}]*phase="compute"[^}}]*replica="{i}"', text) or \
            re.search(rf'dtrain_replica_seconds_total\{{[^}}]*replica="{i}"[^}}]*phase="compute"', text)
    for j in range(2):
        assert re.search(rf'dtrain_shard_applies_total\{{[^}}]*shard="{j}"[^}}]*\}} [1-9]', text), text
        assert re.search(rf'dtrain_shard_busy_ratio\{{[^}}]*shard="{j}"', text)
    # The run's series carry its id (one per start of the pipeline) and its name.
    # (The scrape may carry other runs' series too: runs of earlier tests in this process.)
    steps = [(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2)))
             for m in re.finditer(r'^dtrain_global_step\{(.*)\} ([0-9.e+]+)$', text, re.M)]
    mine = [(labels, value) for labels, value in steps if labels.get("name") == "live"]
    assert len(mine) == 1 and mine[0][1] >= 1, steps
    run_labels = mine[0][0]
    assert re.fullmatch(r"live-[0-9a-f]{8}", run_labels["run"]), mine
    assert run_labels["run"] == result.summary["run_id"]
    # Distributed's own series are still there: dtrain's are added to the same endpoint.
    assert "dask_scheduler_workers" in text
    # The dashboard page answered during the run, with its plots.
    page = taken[-1]["page"]
    assert taken[-1]["page_status"] == 200
    for title in ("Per-shard load", "Time per replica", "Replica step rate", "Loss", "Global steps per second"):
        assert title in page
    assert taken[-1]["js_status"] == 200  # the page's Bokeh script, served by the scheduler too
    # The run's figures over time, as the scheduler holds them when the run ends: its points, the
    # checkpoints and the evaluation on its time axis.
    history = json.loads(scrapes.with_suffix(".data.json").read_text())["history"][result.summary["run_id"]]
    assert len(history["t"]) >= 3 and history["t"] == sorted(history["t"])
    assert sum(v is not None for v in history["loss"]) >= 2 and set(history["groups"]["replica"]) == {"0", "1"}
    assert any(v for v in history["samples_per_s"]) and any(v for v in history["steps_per_s"])
    assert {m.rsplit("/", 1)[0] for m in history["groups"]["memory"]} == {"/job:ps", "/job:worker"}  # every task
    assert {0, 400} <= {m["step"] for m in history["marks"]["checkpoint"]}, history["marks"]
    assert [e["step"] for e in history["evals"]][:1] == [400] and history["evals"][0]["loss"] > 0
