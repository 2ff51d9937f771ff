"""dtrain.plan.tables: where a sparse table's rows live (mod and div over the ps tasks), what the
plan shows of them (text, JSON, ps_bytes), each table's storage dtype and own optimizer (and the
bytes they take, against what a real ps part allocates), pins refused, and a checkpoint's parts
moved onto another partition or storage dtype. No cluster."""

from __future__ import annotations

import json

import pytest
import torch

import dtrain
from dtrain.model.tables import Table, global_rows
from dtrain.plan.tables import (
    ROW_OPTIMIZER_KEYS,
    plan_tables,
    reshard_table,
    restore_problem,
    table_config,
    table_layout,
    to_storage,
)
from dtrain.ps.rows import ROW_OPTIMIZERS, TablePart
from dtrain.ps.shard import ParameterShard
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
    # float32 rows (16 B a row) and adagrad's accumulators (16 B a row)
    assert [p.bytes for p in table.parts] == [32 * r for r in rows]
    assert [p.state_bytes for p in table.parts] == [16 * r for r in rows]
    assert (table.storage, table.optimizer, table.optimizer_name) == ("float32", None, "adagrad")
    assert (table.bytes, table.state_bytes) == (160, 160)
    dense = {s.task: s.bytes for s in plan.shards}  # the linear layer's weight and bias, round robin
    assert "0.weight" not in {v.source for v in plan.variables}
    assert plan.ps_bytes == {t: dense[t] + 32 * r for t, r in zip(dense, rows, strict=True)}
    doc = plan.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["tables"][0]["parts"][1] == {"part": 1, "shard": 1, "task": "/job:ps/task:1", "rows": 3, "bytes": 96,
                                            "first": first[1], "state_bytes": 48}
    text = plan.format()
    assert "tables (sparse, rows on the ps tasks):" in text and f"0.weight  embedding_bag 10x4  float32  adagrad  " \
           f"320 B (160 B rows + 160 B state)  partition {partition}" in text and \
           "part 2 -> /job:ps/task:2  3 rows  96 B" in text


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


def meta_table(storage: str = "float32", optimizer: dict | None = None, rows: int = 1000, dim: int = 8) -> Table:
    return Table(rows, dim, name="t", device="meta", storage=storage, optimizer=optimizer)


ROWWISE = {"name": "rowwise_adagrad", "lr": 0.05, "weight_decay": 1e-4}


def test_a_tables_storage_and_own_optimizer_reach_the_plan_and_the_ps():
    """Table(storage=..., optimizer=...) -> TablePlan fields and bytes -> table_config -> the
    ParameterShard's TablePart (with its own optimizer, not the run's) -> table_layout."""
    (table,) = plan_tables([("emb.weight", meta_table("bfloat16", ROWWISE))], "ps", 2, "mod", run_optimizer="adam")
    assert (table.storage, table.optimizer, table.optimizer_name) == ("bfloat16", ROWWISE, "rowwise_adagrad")
    assert table.bytes == 1000 * 8 * 2 and table.state_bytes == 1000 * 4
    assert [(p.rows, p.bytes, p.state_bytes) for p in table.parts] == [(500, 500 * 20, 500 * 4)] * 2
    (run_default,) = plan_tables([("other.weight", meta_table())], "ps", 2, "mod", run_optimizer="adam")
    assert run_default.optimizer is None and run_default.optimizer_name == "adam"
    assert run_default.bytes == 1000 * 8 * 4 and run_default.state_bytes == 2 * 1000 * 8 * 4
    config = table_config(table, 1, seed=3)
    assert config["storage"] == "bfloat16" and config["optimizer"] == ROWWISE
    shard = ParameterShard({"index": 1, "mode": "async", "steps": 5, "optimizer": {"name": "adam", "lr": 0.1},
                            "tables": [config, table_config(run_default, 1, seed=3)]}, torch.zeros(3))
    part = shard.tables["emb.weight"]
    assert part.weight.dtype == torch.bfloat16 and part.optimizer.name == "rowwise_adagrad"
    assert part.optimizer.weight_decay == 1e-4 and part.nbytes == table.parts[1].bytes
    other = shard.tables["other.weight"]  # no config of its own: the run's adam
    assert other.weight.dtype == torch.float32 and other.optimizer.name == "adam"
    assert table_layout((table,))[0] == {"name": "emb.weight", "num_embeddings": 1000, "dim": 8, "partition": "mod",
                                         "parts": 2, "storage": "bfloat16", "optimizer": "rowwise_adagrad",
                                         "init": "chunked", "dynamic": False}


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(ROW_OPTIMIZER_KEYS))
def test_plan_bytes_are_what_a_ps_part_allocates(storage, name):
    """The plan counts (ps memory check, dtrain plan) what TablePart really holds, for every
    storage dtype and row optimizer; the plan and the ps know the same optimizers."""
    assert set(ROW_OPTIMIZER_KEYS) == set(ROW_OPTIMIZERS)
    config = {"name": name, "lr": 0.1}
    (table,) = plan_tables([("t", meta_table(storage, config, rows=37, dim=6))], "ps", 3, "div")
    for p in table.parts:
        real = TablePart("t", 37, 6, 3, p.part, "div", 1.0, 0, config, storage=storage)
        assert real.nbytes == p.bytes and sum(v.nbytes for v in real.optimizer.tensors().values()) == p.state_bytes


@pytest.mark.parametrize(("storage", "optimizer", "match"), [
    ("int8", None, "table t: storage 'int8' is not one of 'float32', 'bfloat16', 'float16'"),
    ("float32", {"name": "rmsprop", "lr": 0.1}, "optimizer name 'rmsprop' is not one of 'sgd', 'adagrad', "
                                                "'rowwise_adagrad', 'adam'"),
    ("float32", {"name": "adam", "lr": 0.1, "weight_decay": 0.1}, "adam takes lr, betas, eps, not weight_decay "
                                                                  r"\(torch.optim.SparseAdam has none"),
    ("float32", {"name": "rowwise_adagrad", "lr": 0.1, "momentum": 0.9}, "rowwise_adagrad takes lr, eps, "
                                                                         "weight_decay, not momentum"),
    ("float32", {"name": "rowwise_adagrad"}, "rowwise_adagrad needs lr"),
    ("float32", {"name": "sgd", "lr": -1}, "lr -1: lr and eps must be finite numbers > 0"),
])
def test_a_tables_bad_storage_or_optimizer_is_refused_naming_it(storage, optimizer, match):
    with pytest.raises(ValueError, match=match):
        plan_tables([("t", meta_table(storage, optimizer))], "ps", 2, "mod")


def test_a_table_with_the_run_optimizer_needs_a_row_optimizer():
    with pytest.raises(ValueError, match="table t gets the run's optimizer 'momentum', which does not apply"):
        plan_tables([("t", meta_table())], "ps", 2, "mod", run_optimizer="momentum")
    assert plan_tables([("t", meta_table(optimizer={"name": "sgd", "lr": 1.0}))], "ps", 2, "mod",
                       run_optimizer="momentum")[0].optimizer_name == "sgd"


def test_reshard_keeps_bfloat16_rows_and_a_per_row_accumulator_across_2_3_1_parts():
    """A 1-D accumulator (rowwise_adagrad's) is per-row state: every row keeps it through 2 -> 3
    (div) -> 1 parts, and bfloat16 rows stay bfloat16 and bit-identical. Detecting per-row state by
    ``dim() == 2`` would leave the accumulator behind (part 0's copied to every part)."""
    n = 13
    full = torch.randn(n, 4).to(torch.bfloat16)
    acc = torch.arange(n, dtype=torch.float32) + 0.5

    def ids(count: int, strategy: str, p: int) -> list[int]:
        return list(global_rows(n, count, p, strategy))

    parts = [{"weight": full[ids(2, "mod", p)], "optimizer": {"step": 4, "row_sum": acc[ids(2, "mod", p)]}}
             for p in range(2)]
    three = reshard_table(parts, n, (2, "mod"), (3, "div"))
    one = reshard_table(three, n, (3, "div"), (1, "mod"))
    for p, state in enumerate(three):
        assert torch.equal(state["optimizer"]["row_sum"], acc[ids(3, "div", p)])
        assert state["weight"].dtype == torch.bfloat16 and torch.equal(state["weight"], full[ids(3, "div", p)])
    assert torch.equal(one[0]["weight"], full) and torch.equal(one[0]["optimizer"]["row_sum"], acc)
    assert one[0]["optimizer"]["step"] == 4


def test_a_resume_converts_storage_and_refuses_another_row_optimizer():
    """Another storage dtype is converted (rounded to nearest); another row optimizer, or another
    size, is refused with a message naming both."""
    (table,) = plan_tables([("t", meta_table("bfloat16", ROWWISE))], "ps", 2, "mod")
    was = table_layout((table,))[0]
    assert restore_problem(was, table) is None
    assert restore_problem({**was, "storage": "float32"}, table) is None
    assert restore_problem({**was, "optimizer": "adagrad"}, table) == (
        "table t with row optimizer 'adagrad', the pipeline gives it 'rowwise_adagrad': its optimizer state cannot "
        "be used; resume with adagrad")
    old = {k: v for k, v in was.items() if k not in ("storage", "optimizer")}  # a checkpoint from before
    assert restore_problem(old, table, default_optimizer="sgd") is not None
    assert restore_problem(old, table, default_optimizer="rowwise_adagrad") is None
    assert "a table of 999x8 for t (the pipeline's is 1000x8)" in restore_problem({**was, "num_embeddings": 999}, table)
    wide = [{"weight": torch.tensor([[1.0 + 2 ** -9, 3.0]]), "optimizer": {"step": 1}}]
    (narrow,) = to_storage(wide, "bfloat16")
    assert narrow["weight"].dtype == torch.bfloat16 and narrow["weight"].float().tolist() == [[1.0, 3.0]]


def test_the_runs_weight_decay_is_l2_on_touched_rows_for_sgd_and_adagrad_tables():
    """Accepted for sgd and adagrad (the rows get it as L2 on touched rows), refused for adam."""
    base = ("cluster: {jobs: {ps: 1, worker: 1}}\nmodel:\n  input_shape: [2]\n  layers: [{type: embedding, "
            "num_embeddings: 10, dim: 2}, {type: flatten}, {type: linear, out: 1}]\n  loss: mse\n"
            f"data: {{source: {ROOT / 'pipelines' / 'data' / 'ctr_sparse.npz'}}}\n")
    spec = dtrain.loads(base + "optimizer: {name: adagrad, lr: 0.1, weight_decay: 0.01}\n")
    (table,) = plan_tables([("0.weight", meta_table())], "ps", 1, "mod", run_optimizer="adagrad")
    shard = ParameterShard({"index": 0, "mode": "async", "steps": 5, "optimizer": spec.optimizer.model_dump(),
                            "tables": [table_config(table, 0, seed=3)]}, torch.zeros(3))
    assert shard.tables["0.weight"].optimizer.weight_decay == 0.01
    with pytest.raises(SpecError, match="weight_decay does not apply to lazy Adam"):
        dtrain.loads(base + "optimizer: {name: adam, lr: 0.1, weight_decay: 0.01}\n")
