"""The run's figures over time as the scheduler keeps them (dtrain/observe/history.py): rates
from the payloads' steps and times, columns for replicas and tables that appear later, marks,
and the bound on memory for a run of days. Pure: no scheduler, no page."""

from __future__ import annotations

import pytest

from dtrain.observe.history import RunHistory, human_bytes, human_count, human_duration

T0 = 1_700_000_000.0


def payload(i: int, **extra) -> dict:
    """Interval ``i``: two seconds after the last, 100 steps further, replica 1 slowing from i=5."""
    return {"run": "r-1", "time": T0 + 2 * i, "started": T0 - 1, "step": 100 * i, "loss": 2.0 / (i + 1),
            "samples_per_s": 3200.0,
            "replicas": {"0": {"steps_per_s": 40.0}, "1": {"steps_per_s": 40.0 if i < 5 else 5.0}},
            "shards": {"0": {"busy_frac": 0.25, "tables": {"tables.C1.weight": {"live_rows": 10 * i}}}}, **extra}


def test_rates_columns_and_marks():
    h = RunHistory()
    for i in range(8):
        assert h.add(payload(i, checkpoints=[[100 * j, T0 + 2 * j] for j in range(0, i + 1, 4)],
                             eval={"step": 400, "loss": 0.9, "accuracy": 0.7} if i >= 4 else None),
                     memory={"/job:ps/task:0": (1e9 + i, 4e9)})
    s = h.series()
    assert s["t"] == [1.0 + 2 * i for i in range(8)]  # since the run started, not since the first payload
    assert s["steps_per_s"] == [None] + [50.0] * 7  # 100 steps every 2 s
    assert s["loss"][3] == pytest.approx(0.5) and s["samples_per_s"] == [3200.0] * 8
    assert s["groups"]["replica"]["1"] == [40.0] * 5 + [5.0] * 3  # when the straggler began
    assert s["groups"]["rows"]["C1"] == [10.0 * i for i in range(8)]
    assert s["groups"]["memory"]["/job:ps/task:0"][-1] == 1e9 + 7 and s["limits"] == {"/job:ps/task:0": 4e9}
    assert s["marks"]["checkpoint"] == [{"t": 1.0, "step": 0.0}, {"t": 9.0, "step": 400.0}]
    assert [(e["step"], e["loss"]) for e in s["evals"]] == [(400.0, 0.9)]  # logged once, seen four times


def test_a_replica_seen_late_is_padded_and_the_final_payload_is_not_a_point():
    h = RunHistory()
    h.add(payload(0))
    p = payload(1)
    p["replicas"]["2"] = {"steps_per_s": 12.0}
    h.add(p)
    assert h.series()["groups"]["replica"]["2"] == [None, 12.0]
    assert not h.add({**payload(2), "final": True, "checkpoints": [[200, T0 + 4]]}) and len(h) == 2
    assert h.series()["marks"]["checkpoint"] == [{"t": 5.0, "step": 200.0}]  # the last checkpoint, marked
    assert not h.add({"step": 5}) and not h.add(payload(0))  # no time; older than the last point
    assert h.add({"time": T0 + 100, "step": "x", "replicas": "junk", "shards": {"0": None}})
    assert h.series()["steps_per_s"][-1] is None


def test_a_run_of_days_stays_bounded_and_keeps_its_start():
    h = RunHistory(max_points=100)
    n = 3 * 86400 // 10  # three days of a payload every ten seconds
    for i in range(n):
        h.add({"time": T0 + 10 * i, "step": i, "loss": 1.0})
    s = h.series()
    assert 50 <= len(s["t"]) <= 100
    assert s["t"][0] == 0.0 and s["t"][-1] == 10 * (n - 1)  # the start still in view, the newest point exact
    assert s["t"] == sorted(s["t"]) and all(v == 1.0 for v in s["loss"])
    gaps = [b - a for a, b in zip(s["t"], s["t"][1:], strict=False)]
    assert gaps[-1] == 10.0 and gaps[0] > 1000  # recent minutes at full resolution, the start coarser


def test_human_units():
    assert human_bytes(3_000_000_000) == "2.79 GiB" and human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "-"
    assert human_count(1_250_000) == "1.25M" and human_count(12.5) == "12.5" and human_count(4200) == "4.2k"
    assert human_duration(3725) == "1h02m" and human_duration(200) == "3m20s" and human_duration(42.44) == "42.4s"
    assert human_duration(90000) == "1d01h"
