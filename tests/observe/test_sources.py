"""The /dtrain page's columns for a run (dtrain/observe/sources.py), without Bokeh or a scheduler:
a line per replica up to ten, a summary naming the slowest past that, memory per task against
its limit, and a shape that holds while only the figures move."""

from __future__ import annotations

import math

from dtrain.observe.history import RunHistory
from dtrain.observe.sources import MAX_LINES, run_sources, shape, short_task

T0 = 1_700_000_000.0


def payload(i: int, replicas: int) -> dict:
    return {"time": T0 + 2 * i, "step": 100 * i, "loss": 1.0 / (i + 1),
            "replicas": {str(r): {"task": f"/job:worker/task:{r}", "steps_per_s": 50.0 - (40 if r == 7 else 0)}
                         for r in range(replicas)},
            "shards": {"0": {"task": "/job:ps/task:0", "busy_frac": 0.5, "bytes_in": 10, "tables": {
                "tables.C1.weight": {"live_rows": 5, "bytes": 640}}}}}


def sources_for(replicas: int, points: int = 3) -> dict:
    h = RunHistory()
    for i in range(points):
        h.add(payload(i, replicas), {"/job:ps/task:0": (1e9, 4e9), "/job:worker/task:0": (5e8, 0)})
    return run_sources(payload(points - 1, replicas), h.series())


def test_a_line_per_replica_then_a_summary_naming_the_slowest():
    few = sources_for(3)["replica_ts"]
    assert few["names"] == ["replica 0", "replica 1", "replica 2"] and few["y2"] == [50.0] * 3
    many = sources_for(MAX_LINES + 2)["replica_ts"]
    assert many["names"] == ["lowest replica", "median replica", "highest replica"]
    assert many["y0"] == [10.0] * 3 and many["y1"] == [50.0] * 3 and many["low_who"] == ["replica 7"] * 3


def test_tables_memory_and_shape():
    src = sources_for(2)
    assert src["tables"]["table"] == ["C1"] and src["tables"]["bytes"] == [640.0]
    assert math.isnan(src["tables"]["evicted"][0])  # a table with a vocabulary evicts nothing: no bar
    assert src["memory"]["who"] == ["ps 0", "worker 0"] and src["memory"]["used"] == [1e9, 5e8]
    assert src["memory"]["limit"][0] == 4e9 and math.isnan(src["memory"]["limit"][1])
    assert src["memory"]["limit_h"] == ["3.73 GiB", "no limit"]
    assert src["limits"] == {"limit": [4e9]} and src["memory_ts"]["names"] == ["ps 0"]
    assert shape(sources_for(2, points=5)) == shape(src)  # more points, same figures
    assert shape(sources_for(3)) != shape(src)  # a third replica: new bars, new lines
    assert short_task("/job:worker/replica:0/task:3") == "worker 3" and short_task("chief") == "chief"
