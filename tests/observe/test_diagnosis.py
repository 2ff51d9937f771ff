"""The diagnosis rules on figures (no cluster): each finding fires on its case and only there."""

from __future__ import annotations

from dtrain.observe.diagnosis import diagnose, hot_shards, input_bound, staleness, stragglers
from dtrain.spec.observe import ObserveSpec


def rep(rate: float, data: float = 0.01, steps: int = 100, task: str | None = None) -> dict:
    return {"steps": steps, "steps_per_s": rate, "data_frac": data, "task": task}


def test_a_replica_below_half_the_median_is_a_straggler():
    found = stragglers({"0": rep(100), "1": rep(95), "2": rep(30, task="/job:worker/task:2")}, 0.5)
    assert len(found) == 1 and "replica 2 (/job:worker/task:2)" in found[0] and "30.0" in found[0]
    assert stragglers({"0": rep(100), "1": rep(95), "2": rep(51)}, 0.5) == []  # above half: healthy
    assert stragglers({"0": rep(100)}, 0.5) == []  # one replica: nothing to compare with
    assert stragglers({"0": rep(100), "1": rep(1, steps=2)}, 0.5) == []  # too few steps to judge


def test_input_bound_above_the_share():
    found = input_bound({"0": rep(10, data=0.45), "1": rep(10, data=0.05)}, 0.2)
    assert len(found) == 1 and found[0].startswith("input-bound: replica 0") and "45%" in found[0]


def test_hot_shard_by_busy_share_and_by_bytes_naming_what_it_holds():
    shards = {"0": {"busy_frac": 0.95, "pushes": 100, "bytes_in": 10, "bytes_out": 10, "variables": ["0.weight"]},
              "1": {"busy_frac": 0.10, "pushes": 100, "bytes_in": 10, "bytes_out": 10}}
    found = hot_shards(shards, 0.8, 2.0)
    assert len(found) == 1 and "shard 0" in found[0] and "busy 95%" in found[0] and "0.weight" in found[0]
    heavy = {"0": {"bytes_in": 900, "bytes_out": 900, "variables": ["big"]},
             "1": {"bytes_in": 10, "bytes_out": 10}, "2": {"bytes_in": 10, "bytes_out": 10}}
    found = hot_shards(heavy, 0.8, 2.0)
    assert len(found) == 1 and "shard 0" in found[0] and "mean bytes" in found[0] and "big" in found[0]
    even = {str(j): {"bytes_in": 100, "bytes_out": 100, "busy_frac": 0.3, "pushes": 100} for j in range(3)}
    assert hot_shards(even, 0.8, 2.0) == []


def test_staleness_reports_its_cost_to_the_loss():
    shards = {"0": {"staleness": {"le": [0, 1, 2, 4, 8, 16, 32], "counts": [10, 0, 0, 0, 0, 0, 40, 0],
                                  "mean": 20.0, "loss": [0.3, None, None, None, None, None, 0.9, None]}}}
    found = staleness(shards, 4.0)
    assert len(found) == 1 and "20.0" in found[0] and "0.9000" in found[0] and "0.3000" in found[0]
    assert staleness(shards, 25.0) == []


def test_a_healthy_run_yields_no_findings_and_sync_skips_staleness():
    obs = ObserveSpec()
    replicas = {"0": rep(100), "1": rep(90)}
    shards = {"0": {"busy_frac": 0.2, "pushes": 100, "bytes_in": 5, "bytes_out": 5,
                    "staleness": {"le": [0, 1], "counts": [50, 50, 0], "mean": 0.5}}}
    assert diagnose(replicas, shards, obs, async_mode=True, num_replicas=2) == []
    stale = {"0": {**shards["0"], "staleness": {"le": [0, 1], "counts": [0, 0, 50], "mean": 9.0}}}
    assert len(diagnose(replicas, stale, obs, async_mode=True, num_replicas=2)) == 1  # 9 > 2 x 2
    assert diagnose(replicas, stale, obs, async_mode=False, num_replicas=2) == []
