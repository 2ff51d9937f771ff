"""`dtrain plan` and `dtrain run` with sharded sources: the plan's data assignment (text and JSON),
and bad input refused before anything starts (exit 2, file:line, nothing written)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dtrain as dtrain_api
from dtrain.spec.errors import SpecError
from tests.helpers import shards
from tests.helpers.cli import dtrain_cli as dtrain

pytestmark = pytest.mark.slow  # a `dtrain` process per command

PIPELINE = """name: s
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model: {{input_shape: [4], layers: [{{type: linear, out: 2}}], loss: cross_entropy}}
data:
  source: {source}
  epochs: 1
training: {{mode: sync}}
"""


def write_pipeline(tmp_path, source: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(source=source))
    return str(path)


def test_plan_shows_each_replicas_disjoint_row_balanced_shards(tmp_path):
    shards.write(tmp_path / "d", [100, 60, 40, 90, 10], row_group=50)
    out = dtrain("plan", write_pipeline(tmp_path, "d/*.parquet"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)["data"]
    assert data["shards"] + data["eval"]["shards"] == 8 and data["rows"] + data["eval"]["rows"] == 300
    reps = data["replicas"]
    assert [r["task"] for r in reps] == ["/job:worker/task:0", "/job:worker/task:1"]
    assert not set(reps[0]["shards"]) & set(reps[1]["shards"])
    assert sum(r["rows"] for r in reps) == data["rows"] and abs(reps[0]["rows"] - reps[1]["rows"]) <= 50
    text = dtrain("plan", write_pipeline(tmp_path, "d/*.parquet")).stdout
    assert "data: d/*.parquet (parquet)" in text and "part-000.parquet#rg" in text and "1 epoch(s)" in text


def test_a_glob_matching_nothing_exits_2_naming_the_pattern(tmp_path):
    out = dtrain("run", write_pipeline(tmp_path, "nothing/*.parquet"), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    assert f"{tmp_path / 'p.yaml'}:5: data.source: no .npz/.csv/.parquet/.tsv/.tsv.gz file matches 'nothing/*.parquet'" \
        in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_shards_with_other_columns_exit_2_naming_the_file_and_columns(tmp_path):
    shards.write(tmp_path / "d", [20, 20])
    pq.write_table(pa.table({"sample_id": [1.0], "f0": [1], "f1": [0.5], "f2": [0.5], "label": [0]}),
                   tmp_path / "d" / "part-005.parquet")
    out = dtrain("run", write_pipeline(tmp_path, "d/"), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    line = next(x for x in out.stderr.splitlines() if "data.source" in x)
    assert line.startswith(f"{tmp_path / 'p.yaml'}:5: data.source:")
    assert "part-005.parquet" in line and "f0 (double in part-000.parquet, int64 here)" in line
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_an_unreadable_header_exits_2_naming_the_file(tmp_path):
    shards.write(tmp_path / "d", [20, 20])
    (tmp_path / "d" / "part-001.parquet").write_bytes(b"not parquet")
    out = dtrain("plan", write_pipeline(tmp_path, "d/*.parquet"))
    assert out.returncode == 2 and "part-001.parquet: cannot read its parquet header" in out.stderr


@pytest.mark.parametrize(("extra", "key", "message"), [
    ("data: {source: sklearn:iris, readers: 4}", "data.readers", "applies to a sharded source"),
    ("data: {source: sklearn:iris, skip_bad_files: true}", "data.skip_bad_files", "applies to a sharded source"),
    ("data: {source: sklearn:iris, epochs: 2}\ntraining: {mode: sync, replication: in_graph}", "data.epochs",
     "in_graph replication counts training.steps only"),
])
def test_stream_keys_that_would_do_nothing_are_refused(extra, key, message):
    text = "model: {input_shape: [4], layers: [{type: linear, out: 3}], loss: cross_entropy}\n" + extra
    with pytest.raises(SpecError) as err:
        dtrain_api.loads(text)
    assert any(p.path == key and message in p.message for p in err.value.problems), err.value


def test_training_steps_is_optional():
    base = "model: {input_shape: [4], layers: [{type: linear, out: 3}], loss: cross_entropy}\n"
    assert dtrain_api.loads(base).training.steps == 1000
    assert dtrain_api.loads(base + "data: {source: sklearn:iris, epochs: 3}").training.steps == 2**62
    assert dtrain_api.loads(base + "data: {source: sklearn:iris, epochs: 3}\ntraining: {steps: 7}").training.steps == 7


def test_a_dumped_spec_validates_again():
    """Checkpoints and the Python API round-trip specs through model_dump: the stream keys' defaults
    must not count as set."""
    spec = dtrain_api.loads("model: {input_shape: [4], layers: [{type: linear, out: 3}], loss: cross_entropy}")
    again = dtrain_api.PipelineSpec.model_validate(spec.model_dump())
    assert again.data == spec.data and again.training.steps == 1000


def test_integer_columns_are_ids_only_for_a_model_that_takes_ids(tmp_path):
    from dtrain.chief.inputs import file_input
    from dtrain.data.shards import ShardError

    d = tmp_path / "ints"
    d.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"a": [1, 2, 3, 4] * 5, "b": [0, 5, 9, 1] * 5, "label": [0, 1] * 10}),
                       d / f"p{i}.parquet")
    numbers = dtrain_api.loads("model: {input_shape: [2], layers: [{type: linear, out: 2}], loss: cross_entropy}\n"
                               f"data: {{source: '{d}/', eval_source: '{d}/p1.parquet'}}")
    data = file_input(numbers)
    assert not data.train.ids and data.stats.mean is not None  # numbers: standardised like any feature
    ids = dtrain_api.loads("model: {input_shape: [2], layers: [{type: embedding, num_embeddings: 10, dim: 2}, "
                           "{type: flatten}, {type: linear, out: 2}], loss: cross_entropy}\n"
                           f"data: {{source: '{d}/', eval_source: '{d}/p1.parquet'}}\n"
                           "optimizer: {name: adagrad, lr: 0.1}")
    data = file_input(ids)
    assert data.train.ids and data.stats.mean is None  # ids: exact, never standardised
    floats = tmp_path / "floats"
    shards.write(floats, [10, 10])
    with pytest.raises(ShardError, match="takes integer ids"):
        file_input(dtrain_api.loads(ids.model_dump_json().replace(str(d), str(floats)).replace(
            "p1.parquet", "part-001.parquet")))
