"""dtrain.plan.tables: where a sparse table's rows live (mod and div over the ps tasks), what the
plan shows of them (text, JSON, ps_bytes), pins refused, and a checkpoint's parts moved onto
another partition. Pure: no cluster."""

from __future__ import annotations

import json

import pytest
import torch

import dtrain
from dtrain.model.tables import global_rows
from dtrain.plan.tables import reshard_table
from dtrain.spec.errors import SpecError
from tests.helpers.paths import ROOT


def spec(num_ps: int = 3, partition: str = "mod", rows: int = 10, pin: str = "") -> dtrain.PipelineSpec:
    pins = f", variable_devices: {{'{pin}': /job:ps/task:1}}" if pin else ""
    return dtrain.loads(f"""
name: t
cluster: {{jobs: {{ps: {num_ps}, worker: 2}}}}
model:
  input_shape: [8]
  layers: [{{type: embedding_bag, num_embeddings: {rows}, dim: 4, mode: sum}}, {{type: linear, out: 1}}]
  loss: bce_with_logits
placement: {{embedding_partition: {partition}{pins}}}
data: {{source: data/ctr_sparse.npz}}
optimizer: {{name: adagrad, lr: 0.1}}
""", base_dir=ROOT / "pipelines")


@pytest.mark.parametrize(("partition", "rows", "first"), [("mod", [4, 3, 3], [0, 1, 2]), ("div", [4, 3, 3], [0, 4, 7])])
def test_parts_rows_bytes_and_ps_bytes(partition, rows, first):
    plan = dtrain.compile(spec(partition=partition))
    (table,) = plan.tables
    assert (table.name, table.kind, table.num_embeddings, table.dim, table.partition) == \
        ("0.weight", "embedding_bag", 10, 4, partition)
    assert [p.rows for p in table.parts] == rows and [p.first for p in table.parts] == first
    assert [p.task for p in table.parts] == [f"/job:ps/task:{i}" for i in range(3)]
    assert [p.bytes for p in table.parts] == [16 * r for r in rows]
    dense = {s.task: s.bytes for s in plan.shards}  # the linear layer's weight and bias, round robin
    assert "0.weight" not in {v.source for v in plan.variables}
    assert plan.ps_bytes == {t: dense[t] + 16 * r for t, r in zip(dense, rows, strict=True)}
    doc = plan.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["tables"][0]["parts"][1] == {"part": 1, "shard": 1, "task": "/job:ps/task:1", "rows": 3, "bytes": 48,
                                            "first": first[1]}
    text = plan.format()
    assert "tables (sparse, rows on the ps tasks):" in text and f"0.weight  embedding_bag 10x4  160 B  partition " \
           f"{partition}" in text and "part 2 -> /job:ps/task:2  3 rows  48 B" in text


def test_a_table_cannot_be_pinned():
    with pytest.raises(SpecError, match="'0.weight' is a sparse embedding table: its rows are partitioned over every "
                                        "ps task"):
        dtrain.compile(spec(pin="0.weight"))


@pytest.mark.parametrize(("old", "new"), [((2, "mod"), (3, "div")), ((3, "div"), (1, "mod")), ((2, "div"), (2, "mod"))])
def test_reshard_moves_every_row_and_its_state_to_its_new_part(old, new):
    n = 11
    full = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)

    def part(count: int, strategy: str, p: int) -> list[int]:
        return list(global_rows(n, count, p, strategy))

    parts = [{"weight": full[part(*old, p)], "optimizer": {"step": 7, "sum": -full[part(*old, p)]}}
             for p in range(old[0])]
    moved = reshard_table(parts, n, old, new)
    assert len(moved) == new[0]
    for p, state in enumerate(moved):
        assert torch.equal(state["weight"], full[part(*new, p)])
        assert torch.equal(state["optimizer"]["sum"], -full[part(*new, p)]) and state["optimizer"]["step"] == 7
    with pytest.raises(ValueError, match="part state"):
        reshard_table(parts[:-1], n, old, new)
