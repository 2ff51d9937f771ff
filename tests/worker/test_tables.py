"""Sparse embedding tables end to end on the in-process cluster: sync replication with N replicas
equals single-process torch with sparse embeddings and batch N*b (torch.optim.SGD / Adagrad on
sparse gradients, SparseAdam), over 1 or 2 ps tasks, mod and div partitions, the shared-memory and
the socket-bytes data plane and the Dask actor path; and only touched rows move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtrain
from tests.helpers.reference import max_abs_diff, single_process

# torch's own sparse Adagrad (the reference) warns about its sparse invariant checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
TOLERANCE = 1e-5
OPTIMIZERS = {"sgd": "{name: sgd, lr: 0.5}", "adagrad": "{name: adagrad, lr: 0.1}",
              "adam": "{name: adam, lr: 0.01}"}
VOCAB = 5000


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory):
    """Zipf-distributed ids over 4 fields and a learnable 0/1 label (hot ids repeat within batches)."""
    rng = np.random.default_rng(0)
    x = (rng.zipf(1.3, (600, 4)) - 1) % VOCAB
    w = rng.normal(size=VOCAB)
    y = (w[x].sum(1) > 0).astype(np.int64)
    path = tmp_path_factory.mktemp("ids") / "ids.npz"
    np.savez(path, x=x.astype(np.int32), y=y)
    return path


def table_spec(path, num_ps: int, replicas: int, optimizer: str, partition: str = "mod", steps: int = 50,
               layer: str = "embedding", extra: str = "") -> dtrain.PipelineSpec:
    first = ("{type: embedding, num_embeddings: %d, dim: 4}" if layer == "embedding"
             else "{type: embedding_bag, num_embeddings: %d, dim: 4, mode: sum}") % VOCAB
    flatten = "{type: flatten}, " if layer == "embedding" else ""
    return dtrain.loads(f"""
name: table-fidelity
cluster: {{jobs: {{ps: {num_ps}, worker: {replicas}}}}}
model:
  input_shape: [4]
  layers: [{first}, {flatten}{{type: linear, out: 8}}, {{type: relu}}, {{type: linear, out: 1}}]
  loss: bce_with_logits
placement: {{embedding_partition: {partition}}}
data: {{source: {path}, batch_size: 16}}
optimizer: {OPTIMIZERS[optimizer]}
training: {{mode: sync, steps: {steps}, seed: 5{extra}}}
summary: {{every_steps: 25, tensorboard: false}}
""", base_dir=".")


@pytest.mark.parametrize(("num_ps", "replicas", "optimizer", "partition", "extra"), [
    (1, 2, "sgd", "mod", ""),
    (2, 2, "sgd", "div", ""),
    (2, 2, "adagrad", "mod", ""),
    (2, 3, "adagrad", "div", ", shared_memory: false"),
    (1, 2, "adam", "mod", ", transport: dask"),
    (2, 2, "adam", "div", ""),
])
def test_sync_tables_match_single_process_sparse_torch(inproc_client, tmp_path, ids_file, num_ps, replicas,
                                                        optimizer, partition, extra):
    spec = table_spec(ids_file, num_ps, replicas, optimizer, partition, extra=extra)
    plan = dtrain.compile(spec)
    assert [t.name for t in plan.tables] == ["0.weight"]
    assert "0.weight" not in {v.source for v in plan.variables}  # never in a dense shard

    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")

    assert result.summary["status"] == "completed"
    assert result.summary["global_step"] == 50
    reference = single_process(spec, replicas)
    assert reference[0].weight.grad.is_sparse  # the yardstick really is torch's sparse path
    assert max_abs_diff(result.model, reference) <= TOLERANCE
    # model.pt: the whole table as a normal state_dict entry, loadable into build_model(spec)
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (VOCAB, 4)
    model = dtrain.build_model(spec)
    model.load_state_dict(state)
    assert float((model[0].weight - reference[0].weight).detach().abs().max()) <= TOLERANCE


def test_mod_and_div_give_identical_results(inproc_client, tmp_path, ids_file):
    runs = [dtrain.run(table_spec(ids_file, 2, 2, "adagrad", p, steps=20, layer="embedding_bag"),
                       client=inproc_client, run_dir=tmp_path / p) for p in ("mod", "div")]
    assert max_abs_diff(runs[0].model, runs[1].model) <= 1e-6
    # and training moved the table away from its initial values (the comparison has teeth)
    init = dtrain.build_model(table_spec(ids_file, 2, 2, "adagrad", "mod", layer="embedding_bag"))
    assert float((runs[0].model[0].weight - init[0].weight).detach().abs().max()) > 1e-3


def test_the_fidelity_check_has_teeth(inproc_client, tmp_path, ids_file):
    """A reference with another batch size (another data order) is far off."""
    spec = table_spec(ids_file, 1, 2, "sgd", steps=30)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert max_abs_diff(result.model, single_process(spec, 3, steps=30)) > 1e-3
