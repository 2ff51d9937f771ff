"""training.sync_tokens / init_tokens: what validation and the plan accept and refuse (no cluster)."""

from __future__ import annotations

import numpy as np
import pytest

import dtrain
from dtrain.spec.errors import SpecError

BASE = """\
name: tokens
cluster: {{jobs: {{ps: {ps}, worker: {workers}}}}}
model:
  input_shape: [4]
  layers:
    - {{type: linear, out: 3}}
{placement}training: {{mode: sync, sync_tokens: true{training}}}
"""


def spec_of(ps: int = 1, workers: int = 2, training: str = "", placement: str = "") -> dtrain.PipelineSpec:
    return dtrain.loads(BASE.format(ps=ps, workers=workers, training=training, placement=placement), base_dir=".")


def problems(**kwargs: str | int) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec_of(**kwargs)  # type: ignore[arg-type]
    return [(p.path, p.message) for p in info.value.problems]


def test_fewer_replicas_than_gradients_per_update_is_valid_with_tokens_x1():
    spec = spec_of(training=", replicas_to_aggregate: 4, init_tokens: 2")
    plan = dtrain.compile(spec)
    assert plan.sync_tokens and plan.replicas_to_aggregate == 4 and plan.num_replicas == 2
    # Replica r's k-th batch is not in step k (a gradient may be dropped or count twice): resumes
    # use the local steps the replicas reported, as with backups.
    assert not plan.lockstep
    assert "aggregate 4 with TF's token queue" in plan.format().splitlines()[0]
    assert plan.to_json()["sync_tokens"] is True
    # The default barrier mode keeps its lockstep.
    assert dtrain.compile(dtrain.loads(BASE.format(ps=1, workers=2, training="", placement="").replace(
        ", sync_tokens: true", ""), base_dir=".")).lockstep


def test_init_tokens_must_let_the_first_update_complete():
    assert spec_of(training=", replicas_to_aggregate: 5, init_tokens: 3").training.init_tokens == 3
    assert problems(training=", replicas_to_aggregate: 5, init_tokens: 2") == [
        ("training.init_tokens", "2 tokens cannot start training: replicas_to_aggregate 5 - 2 replicas = 3 "
         "gradients must be pushed on init tokens before the first update; set init_tokens >= 3 (as TF's "
         "get_init_tokens_op)")]
    with pytest.raises(SpecError, match="training.init_tokens: .*>= 0"):
        spec_of(training=", init_tokens: -1")


@pytest.mark.parametrize(("kwargs", "path", "message"), [
    ({"training": ", replication: in_graph"}, "training.sync_tokens", "needs replication: between_graph"),
    ({"placement": "placement: {variable_devices: {'0.': /job:worker/task:1}}\n"},
     "placement.variable_devices.0.", "with sync_tokens every variable lives on /job:ps/task:0"),
    ({"workers": "{min: 1, max: 3}", "training": ", replicas_to_aggregate: all"}, "training.sync_tokens",
     "needs a fixed number of replicas"),
])
def test_what_the_token_mode_refuses(kwargs, path, message):
    found = problems(**kwargs)
    assert any(p == path and message in m for p, m in found), found


def test_sync_tokens_is_refused_with_sparse_tables(tmp_path):
    np.savez(tmp_path / "ids.npz", x=np.zeros((8, 2), np.int32), y=np.zeros(8, np.int64))
    text = f"""
name: tokens-tables
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  input_shape: [2]
  layers: [{{type: embedding, num_embeddings: 10, dim: 2, sparse: true}}, {{type: flatten}}, {{type: linear, out: 2}}]
data: {{source: {tmp_path / 'ids.npz'}, batch_size: 4}}
training: {{mode: sync, sync_tokens: true}}
"""
    with pytest.raises(SpecError, match="training.sync_tokens: sync_tokens does not support sparse embedding"):
        dtrain.loads(text, base_dir=".")


def test_a_module_with_sparse_tables_is_refused_when_compiled(tmp_path):
    """A model.module's tables are known once it is built: compile refuses them."""
    np.savez(tmp_path / "ids.npz", x=np.zeros((8, 4), np.int32), y=np.zeros(8, np.int64))
    spec = dtrain.loads(f"""
name: tokens-module
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model: {{module: tests.helpers.models:TwoTables, loss: bce_with_logits}}
data: {{source: {tmp_path / 'ids.npz'}, batch_size: 4}}
training: {{mode: sync, sync_tokens: true}}
""", base_dir=".")
    with pytest.raises(SpecError, match="sync_tokens needs every variable in one shard and no sparse tables"):
        dtrain.compile(spec)
