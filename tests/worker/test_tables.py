"""Sparse embedding tables end to end on the in-process cluster: sync replication with N replicas
equals single-process torch with sparse embeddings and batch N*b (torch.optim.SGD / Adagrad on
sparse gradients, SparseAdam), over 1 or 2 ps tasks, mod and div partitions, the shared-memory and
the socket-bytes data plane and the Dask actor path; and only touched rows move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.chief import ps_shards
from dtrain.chief import tables as chief_tables
from dtrain.model.tables import Table
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
               layer: str = "embedding", extra: str = "", checkpoint_every: int | None = None,
               vocab: int = VOCAB, mode: str = "sync", eval_every: int | None = None) -> dtrain.PipelineSpec:
    first = ("{type: embedding, num_embeddings: %d, dim: 4}" if layer == "embedding"
             else "{type: embedding_bag, num_embeddings: %d, dim: 4, mode: sum}") % vocab
    checkpoint = f"checkpoint: {{every_steps: {checkpoint_every}, keep: 3}}" if checkpoint_every else ""
    if eval_every:
        checkpoint += f"\neval: {{every_steps: {eval_every}}}"
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
training: {{mode: {mode}, steps: {steps}, seed: 5{extra}}}
summary: {{every_steps: 25, tensorboard: false}}
{checkpoint}
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


# ------------------------------------------------------------------------------ checkpoints and resume

@pytest.mark.parametrize(("num_ps", "partition"), [(2, "mod"), (1, "mod"), (2, "div"), (1, "div")])
def test_resume_restores_rows_and_their_adagrad_state_under_any_partition(inproc_client, tmp_path, ids_file,
                                                                           num_ps, partition, monkeypatch):
    """Checkpointed at step 20 by 2 ps tasks (mod), resumed to step 40 as written, by 1 ps
    tasks, or partitioned div: every row and its accumulator come back where its id lives now, and
    training goes on exactly as an uninterrupted run's (sync, fixed seed)."""
    monkeypatch.setattr(chief_tables, "TABLE_CHUNK_ROWS", 999)  # each part (2500 rows) read in 3 chunks
    full = table_spec(ids_file, 2, 2, "adagrad", steps=40)
    ref = dtrain.run(full, client=inproc_client, run_dir=tmp_path / "ref")
    dtrain.run(table_spec(ids_file, 2, 2, "adagrad", steps=20, checkpoint_every=10), client=inproc_client,
               run_dir=tmp_path / "run")
    written = ckpt.latest(tmp_path / "run")
    assert written.step == 20
    parts = [sh["tables"]["0.weight"] for sh in written.payload["shards"]]
    assert [p["weight"].shape[0] for p in parts] == [VOCAB // 2, VOCAB // 2] and parts[0]["optimizer"]["step"] == 20
    assert all(bool(p["optimizer"]["sum"].any()) for p in parts)  # the accumulators are in it
    again = table_spec(ids_file, num_ps, 2, "adagrad", partition, steps=40, checkpoint_every=10)
    resumed = dtrain.run(again, client=inproc_client, run_dir=tmp_path / "run", resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["start_step"] == 20
    assert max_abs_diff(resumed.model, ref.model) <= 1e-6
    # teeth: the rows moved after step 20 (a resume from the initial table, or from rows placed on
    # the wrong part, would not match)
    mid = dtrain.run(table_spec(ids_file, 2, 2, "adagrad", steps=20), client=inproc_client, run_dir=tmp_path / "mid")
    assert max_abs_diff(mid.model, ref.model) > 1e-3


def test_resume_of_another_table_size_is_refused(inproc_client, tmp_path, ids_file):
    dtrain.run(table_spec(ids_file, 1, 2, "sgd", steps=10, checkpoint_every=10), client=inproc_client,
               run_dir=tmp_path / "run")
    bigger = table_spec(ids_file, 1, 2, "sgd", steps=20, checkpoint_every=10, vocab=2 * VOCAB)
    with pytest.raises(dtrain.RunError, match=f"holds a table of {VOCAB}x4 for 0.weight \\(the pipeline's is "
                                              f"{2 * VOCAB}x4\\)"):
        dtrain.run(bigger, client=inproc_client, run_dir=tmp_path / "run", resume=True)


# ------------------------------------------------------------------------------ model.module tables

def module_spec(path, optimizer: str, steps: int = 40, partition: str = "mod") -> dtrain.PipelineSpec:
    return dtrain.loads(f"""
name: module-tables
cluster: {{jobs: {{ps: 2, worker: 2}}}}
model: {{module: tests.helpers.models:TwoTables, loss: bce_with_logits}}
placement: {{embedding_partition: {partition}}}
data: {{source: {path}, batch_size: 16}}
optimizer: {OPTIMIZERS[optimizer]}
training: {{mode: sync, steps: {steps}, seed: 5}}
summary: {{every_steps: 20, tensorboard: false}}
""", base_dir=".")


@pytest.mark.parametrize(("optimizer", "partition"), [("sgd", "mod"), ("adam", "div")])
def test_a_modules_sparse_embeddings_become_ps_tables(inproc_client, tmp_path, ids_file, optimizer, partition):
    """model.module with nn.Embedding and nn.EmbeddingBag (sparse=True) over columns it picks and
    ids it computes (a record pass finds them), and a dense nn.Embedding: the two sparse ones live
    on the ps as tables, the run equals single-process torch with the same module."""
    spec = module_spec(ids_file, optimizer, partition=partition)
    plan = dtrain.compile(spec)
    assert [t.name for t in plan.tables] == ["users.weight", "items.weight"]
    assert [t.kind for t in plan.tables] == ["embedding", "embedding_bag"]
    assert "dense.weight" in {v.source for v in plan.variables}  # sparse=False: an ordinary variable
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    reference = single_process(spec, 2)
    assert reference.users.weight.grad.is_sparse
    assert max_abs_diff(result.model, reference) <= TOLERANCE
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert state["items.weight"].shape == (VOCAB, 4)
    # teeth: the tables trained (the comparison would catch rows pushed to the wrong table)
    init = dtrain.build_model(spec)
    assert float((result.model.items.weight - init.items.weight).detach().abs().max()) > 1e-3


def test_async_applies_each_push_at_once(inproc_client, tmp_path, ids_file):
    """Async with one replica is plain sequential training: each push's rows applied at once, the
    next batch's rows read after that apply (within 1e-5 of single-process torch, batch b)."""
    spec = table_spec(ids_file, 2, 1, "adagrad", steps=40, mode="async")
    assert spec.training.mode == "async"
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed" and result.summary["global_step"] == 40
    assert max_abs_diff(result.model, single_process(spec, 1)) <= TOLERANCE


def test_an_id_a_module_computes_outside_its_table_fails_the_run(inproc_client, tmp_path, ids_file):
    """The data's ids are in range, but the module shifts them past its 50-row table: the ps
    refuses the request (nothing read or written) and the run fails naming the table and the id."""
    x = np.load(ids_file)["x"][:, :3] % 50  # TinyEmbedding: 3 fields
    path = tmp_path / "small.npz"
    np.savez(path, x=x, y=np.load(ids_file)["y"])
    spec = dtrain.loads(f"""
name: bad-ids
cluster: {{jobs: {{ps: 1, worker: 1}}}}
model: {{module: tests.helpers.models:TinyEmbedding, kwargs: {{shift: 50}}, loss: bce_with_logits}}
data: {{source: {path}, batch_size: 8}}
optimizer: {{name: sgd, lr: 0.1}}
training: {{mode: async, steps: 20}}
""", base_dir=".")
    with pytest.raises(dtrain.RunError, match=r"id \d+ is outside table emb.weight \(num_embeddings 50, ids 0..49\)"):
        dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")


def test_evaluation_reads_only_the_rows_its_batches_touch(inproc_client, tmp_path, ids_file, monkeypatch):
    """Periodic evaluation gathers, per batch, the rows of that batch's ids from the ps; only
    model.pt (and the final evaluation, on that whole model) reads the whole table, once."""
    gathered: list[int] = []
    whole: list[str] = []
    real_gather, real_pull = ps_shards.ShardGroup.gather_rows, ps_shards.ShardGroup.pull_table

    def gather_rows(self, name, ids):
        if not whole or whole[-1] != "inside":
            gathered.append(len(ids))
        return real_gather(self, name, ids)

    def pull_table(self, name, chunk_rows=1 << 20):
        whole.append("inside")
        try:
            return real_pull(self, name, chunk_rows)
        finally:
            whole[-1] = name

    monkeypatch.setattr(ps_shards.ShardGroup, "gather_rows", gather_rows)
    monkeypatch.setattr(ps_shards.ShardGroup, "pull_table", pull_table)
    spec = table_spec(ids_file, 2, 2, "sgd", steps=30, eval_every=25)  # (summaries every 25 steps)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["eval"]["accuracy"] > 0
    assert whole == ["0.weight"]  # model.pt, at the end
    from dtrain.worker.replica import dataset_for

    test_ids = len(np.unique(dataset_for(spec).x_test))
    assert gathered and max(gathered) <= test_ids < VOCAB  # the evaluation at step 25


# ------------------------------------------------------------------------------ compact tables

ROWWISE = {"name": "rowwise_adagrad", "lr": 0.1}


def every_table(monkeypatch, storage: str, optimizer: dict | None) -> None:
    """Give every Table built from now on this storage dtype and optimizer (what a module's
    Table(storage=..., optimizer=...) sets; the replicas and the ps tasks run in this process)."""
    init = Table.__init__

    def compact(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.storage, self.optimizer = storage, optimizer

    monkeypatch.setattr(Table, "__init__", compact)


def test_compact_tables_train_checkpoint_and_resume_into_another_storage(inproc_client, tmp_path, ids_file,
                                                                         monkeypatch):
    """bfloat16 rows with rowwise_adagrad on 2 ps tasks (the parts' states cross Dask): the run
    trains close to the same table in float32, model.pt holds the bfloat16 values; the checkpoint keeps
    bfloat16 rows and a (rows,) accumulator, read in chunks; a resume onto 1 ps task in float32
    converts and repartitions them; a resume with another row optimizer is refused."""
    monkeypatch.setattr(chief_tables, "TABLE_CHUNK_ROWS", 999)
    every_table(monkeypatch, "float32", ROWWISE)
    wide = dtrain.run(table_spec(ids_file, 2, 2, "sgd", steps=20), client=inproc_client, run_dir=tmp_path / "wide")
    every_table(monkeypatch, "bfloat16", ROWWISE)
    spec = table_spec(ids_file, 2, 2, "sgd", steps=20, checkpoint_every=10)
    assert dtrain.compile(spec).tables[0].storage == "bfloat16"
    compact = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert compact.summary["status"] == "completed"
    table = compact.model[0].weight.detach()
    assert torch.equal(table, table.to(torch.bfloat16).float())  # gathered from bfloat16 rows
    initial = dtrain.build_model(spec)[0].weight.detach()
    assert float((table - initial).abs().max()) > 0.05  # trained
    # Close to float32 on average (a row's first adagrad steps have about lr's size whatever its
    # gradient, so single elements can differ by up to 2 lr; the mean cannot, without drift).
    assert float((table - wide.model[0].weight.detach()).abs().mean()) < 0.005
    assert abs(compact.summary["final_loss"] - wide.summary["final_loss"]) < 0.005
    written = ckpt.latest(tmp_path / "run")
    parts = [sh["tables"]["0.weight"] for sh in written.payload["shards"]]
    assert all(p["weight"].dtype == torch.bfloat16 and p["optimizer"]["row_sum"].shape == (VOCAB // 2,)
               and bool(p["optimizer"]["row_sum"].any()) for p in parts)
    assert {k: written.payload["layout"]["tables"][0][k] for k in ("storage", "optimizer")} == \
        {"storage": "bfloat16", "optimizer": "rowwise_adagrad"}

    every_table(monkeypatch, "float32", ROWWISE)
    resumed = dtrain.run(table_spec(ids_file, 1, 2, "sgd", steps=30, checkpoint_every=10), client=inproc_client,
                         run_dir=tmp_path / "run", resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["start_step"] == 20
    (part,) = [sh["tables"]["0.weight"] for sh in ckpt.latest(tmp_path / "run").payload["shards"][:1]]
    assert part["weight"].dtype == torch.float32 and part["optimizer"]["row_sum"].shape == (VOCAB,)
    every_table(monkeypatch, "float32", {"name": "adagrad", "lr": 0.1})
    with pytest.raises(dtrain.RunError, match="holds table 0.weight with row optimizer 'rowwise_adagrad', the "
                                              "pipeline gives it 'adagrad'"):
        dtrain.run(table_spec(ids_file, 1, 2, "sgd", steps=40), client=inproc_client, run_dir=tmp_path / "run",
                   resume=True)
