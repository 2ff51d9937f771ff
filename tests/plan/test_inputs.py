"""The input plan: disjoint, row-balanced shards per replica; the plan's text and JSON."""

from __future__ import annotations

import random

import pytest

from dtrain.data.shards import Manifest, Shard
from dtrain.plan.inputs import assign_shards, data_json, format_data, plan_data
from dtrain.spec.errors import SpecError


@pytest.mark.parametrize("seed", range(5))
def test_assignment_is_disjoint_complete_and_balanced_within_the_largest_shard(seed):
    rng = random.Random(seed)
    rows = [rng.randint(1, 1000) for _ in range(rng.randint(4, 40))]
    replicas = rng.randint(1, 4)
    groups = assign_shards(rows, replicas)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(rows))) and all(g == sorted(g) and g for g in groups)
    loads = [sum(rows[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(rows)
    assert groups == assign_shards(rows, replicas)  # deterministic


def test_fewer_shards_than_replicas_is_a_spec_error_at_data_source():
    m = Manifest("d/*.csv", "csv", (Shard("d/a.csv", 5),), ("x",), "label", False, (1,))
    with pytest.raises(SpecError) as err:
        plan_data(m, ["/job:worker/task:0", "/job:worker/task:1"])
    assert err.value.problems[0].path == "data.source" and "1 shard(s) for 2 replicas" in err.value.problems[0].message


def test_json_and_text():
    shards = tuple(Shard(f"d/f{i}.parquet", rows, 0) for i, rows in enumerate([30, 20, 10]))
    m = Manifest("d/", "parquet", shards, ("a", "b"), "label", False, (2,))
    data = plan_data(m, ["/job:worker/task:0", "/job:worker/task:1"])
    doc = data_json(data)
    assert doc == {"source": "d/", "format": "parquet", "shards": 3, "rows": 60, "eval": {"shards": 0, "rows": 0},
                   "replicas": [{"task": "/job:worker/task:0", "shards": ["f0.parquet#rg0"], "rows": 30},
                                {"task": "/job:worker/task:1", "shards": ["f1.parquet#rg0", "f2.parquet#rg0"],
                                 "rows": 30}]}
    text = format_data(data)
    assert text[0] == "data: d/ (parquet): 3 shard(s), 60 rows" and "f2.parquet#rg0" in text[2]
