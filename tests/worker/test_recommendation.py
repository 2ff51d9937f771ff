"""A DLRM over multi-hot, weighted features end to end on the in-process cluster: sync replication
with 2 replicas over 1 or 2 ps tasks equals single-process torch with batch 2b, written here with
torch's own ``nn.EmbeddingBag(ids, offsets, per_sample_weights)`` (sparse gradients) and
``torch.optim.Adagrad``, from the raw id lists (not through dtrain's codec)."""

from __future__ import annotations

from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import torch
from torch import nn

import dtrain
from dtrain.model.recommendation import record_layout

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
TOLERANCE = 1e-5
ROWS, BATCH, STEPS = 2400, 16, 50
FEATURES = [("C1", "A", 1, False), ("C2", "B", 3, True), ("C3", "A", 2, False), ("C4", "C", 4, True)]
TABLE_ROWS = {"A": 300, "B": 97, "C": 50}


def rec_spec(num_ps: int) -> dtrain.PipelineSpec:
    cats = ", ".join(f"{{name: {n}, table: {t}, max_ids: {m}, weighted: {str(w).lower()}}}"
                     for n, t, m, w in FEATURES)
    table_lines = "\n".join(f"    {t}: {{num_embeddings: {r}, dim: 4, init_std: 0.5}}"
                            for t, r in TABLE_ROWS.items())
    return dtrain.loads(f"""
name: dlrm-fidelity
cluster: {{jobs: {{ps: {num_ps}, worker: 2}}}}
model:
  features:
    dense: [I1, I2, I3]
    categorical: [{cats}]
  tables:
{table_lines}
  dlrm: {{bottom: [8, 4], interaction: dot, top: [8, 1]}}
  loss: bce_with_logits
data: {{batch_size: {BATCH}, shuffle: false, test_fraction: 0.1}}
optimizer: {{name: adagrad, lr: 0.1}}
training: {{mode: sync, steps: {STEPS}, seed: 3}}
summary: {{every_steps: 25, tensorboard: false}}
""", base_dir=".")


@pytest.fixture(scope="module")
def raw():
    """Dense values and, per feature, CSR id lists (lengths 0..max_ids, Zipf ids beyond the tables'
    rows, so the modulo fold matters) with weights; a label learnable from them."""
    rng = np.random.default_rng(7)
    dense = rng.normal(size=(ROWS, 3)).astype(np.float32)
    cats = []
    for _, _, max_ids, weighted in FEATURES:
        lengths = rng.integers(0, max_ids + 1, ROWS) if max_ids > 1 else np.ones(ROWS, np.int64)
        ids = (rng.zipf(1.4, int(lengths.sum())) * 7919).astype(np.int64)
        weights = rng.random(int(lengths.sum())).astype(np.float32) + 0.5 if weighted else None
        cats.append((ids, lengths, weights))
    y = ((cats[0][0] % 5) < 2).astype(np.float32)
    return dense, cats, y


def pack(spec, raw):
    dense, cats, y = raw
    layout = record_layout(spec.model.features.model_dump())
    return layout.pack(dense, [(ids, lengths) for ids, lengths, _ in cats], [w for _, _, w in cats]), y


class ReferenceDLRM(nn.Module):
    """The DLRM in plain torch: one nn.EmbeddingBag(sparse=True) per table."""

    def __init__(self, trained: nn.Module):
        super().__init__()
        self.bags = nn.ModuleDict({t: nn.EmbeddingBag(r, 4, mode="sum", sparse=True) for t, r in TABLE_ROWS.items()})
        self.bottom = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(4 + 10, 8), nn.ReLU(), nn.Linear(8, 1))
        with torch.no_grad():  # the same initial values as dtrain's (its seeded tables and layers)
            for t in TABLE_ROWS:
                self.bags[t].weight.copy_(trained.tables[t].weight)
            for mine, theirs in ((self.bottom, trained.bottom), (self.top, trained.top)):
                mine.load_state_dict(theirs.state_dict())

    def forward(self, dense, features):
        bottom = self.bottom(dense)
        pooled = [self.bags[t](ids % TABLE_ROWS[t], offsets, per_sample_weights=w)
                  for (_, t, _, _), (ids, offsets, w) in zip(FEATURES, features, strict=True)]
        t = torch.stack([bottom, *pooled], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        i, j = torch.tril_indices(5, 5, offset=-1)
        return self.top(torch.cat([bottom, z[:, i, j]], dim=1))


def reference_run(spec, raw, order: np.ndarray) -> ReferenceDLRM:
    """50 steps of batch 2b over the training rows in ``order`` (each replica's rows, interleaved
    by step as sync replication aggregates them)."""
    dense, cats, y = raw
    starts = [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths, _ in cats]
    model = ReferenceDLRM(dtrain.build_model(spec))
    tables = [p for n, p in model.named_parameters() if n.startswith("bags.")]
    others = [p for n, p in model.named_parameters() if not n.startswith("bags.")]
    opts = [torch.optim.Adagrad(tables, lr=0.1), torch.optim.Adagrad(others, lr=0.1)]
    loss_fn = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        rows = order[step]
        features = []
        for (ids, _, weights), start in zip(cats, starts, strict=True):
            pieces = [np.arange(start[r], start[r + 1]) for r in rows]
            flat = np.concatenate(pieces).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])[:-1]])
            features.append((torch.from_numpy(ids[flat]), torch.from_numpy(offsets).long(),
                             None if weights is None else torch.from_numpy(weights[flat])))
        for opt in opts:
            opt.zero_grad()
        loss_fn(model(torch.from_numpy(dense[rows]), features).reshape(-1), torch.from_numpy(y[rows])).backward()
        for opt in opts:
            opt.step()
    return model


def replica_rows(plan, chunk: int) -> list[np.ndarray]:
    """The rows each replica reads, in order (shuffle off: its partitions in assignment order)."""
    out = []
    for rep in plan.data.replicas:
        out.append(np.concatenate([np.arange(int(p.path.split(":")[1]) * chunk, int(p.path.split(":")[1]) * chunk
                                             + p.rows) for p in rep.parts]))
    return out


@pytest.mark.parametrize("num_ps", [1, 2])
def test_sync_dlrm_matches_single_process_embedding_bags(inproc_client, tmp_path, raw, num_ps):
    spec = rec_spec(num_ps)
    x, y = pack(spec, raw)
    chunk = 200
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run",
                        data=(da.from_array(x, chunks=(chunk, x.shape[1])), da.from_array(y, chunks=chunk)))
    assert result.summary["status"] == "completed" and result.summary["global_step"] == STEPS
    evaluation = result.summary["eval"]  # a binary label: log loss and AUC beside the loss
    assert evaluation["log_loss"] == evaluation["loss"] and 0.5 < evaluation["auc"] <= 1.0
    assert sorted(t.name for t in result.plan.tables) == [f"tables.{t}.weight" for t in sorted(TABLE_ROWS)]
    mine = replica_rows(result.plan, chunk)
    order = np.stack([np.concatenate([r[s * BATCH:(s + 1) * BATCH] for r in mine]) for s in range(STEPS)])
    reference = reference_run(spec, raw, order)
    assert reference.bags["A"].weight.grad.is_sparse  # the yardstick is torch's sparse path
    trained = result.model
    diffs = {t: float((trained.tables[t].weight - reference.bags[t].weight).detach().abs().max()) for t in TABLE_ROWS}
    diffs["bottom"] = max(float((a - b).detach().abs().max()) for a, b in zip(trained.bottom.parameters(),
                                                                      reference.bottom.parameters(), strict=True))
    diffs["top"] = max(float((a - b).detach().abs().max()) for a, b in zip(trained.top.parameters(),
                                                                   reference.top.parameters(), strict=True))
    assert max(diffs.values()) <= TOLERANCE, diffs
    # teeth: training moved every table and the MLPs away from their initial values
    init = dtrain.build_model(spec)
    for t in TABLE_ROWS:
        assert float((trained.tables[t].weight - init.tables[t].weight).detach().abs().max()) > 1e-3, t


def test_the_dlrm_fidelity_check_has_teeth(inproc_client, tmp_path, raw):
    """The same reference fed the replicas' rows in another order is far off."""
    spec = rec_spec(1)
    x, y = pack(spec, raw)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run",
                        data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))
    mine = replica_rows(result.plan, 200)
    swapped = np.stack([np.concatenate([r[(s + 1) * BATCH:(s + 2) * BATCH] for r in mine]) for s in range(STEPS)])
    reference = reference_run(spec, raw, swapped)
    assert max(float((result.model.tables[t].weight - reference.bags[t].weight).detach().abs().max())
               for t in TABLE_ROWS) > 1e-3


# ------------------------------------------------------------------------------ tables without a vocabulary

def small_ids_spec(num_ps: int, dynamic: str | None) -> dtrain.PipelineSpec:
    """One table per feature over ids below 400: fixed (400 rows, fold none) or ``dynamic``."""
    table = "{num_embeddings: 400, fold: none, dim: 4, init_std: 0.5}" if dynamic is None else \
        f"{{dim: 4, init_std: 0.5, {dynamic}}}"
    return dtrain.loads(f"""
name: dlrm-dynamic
cluster: {{jobs: {{ps: {num_ps}, worker: 2}}}}
model:
  features:
    dense: [I1, I2, I3]
    categorical: [{{name: C1}}, {{name: C2, max_ids: 3, weighted: true}}]
  tables: {{C1: {table}, C2: {table}}}
  dlrm: {{bottom: [8, 4], top: [8, 1]}}
  loss: bce_with_logits
data: {{batch_size: {BATCH}, shuffle: false, test_fraction: 0.1}}
optimizer: {{name: adagrad, lr: 0.1}}
training: {{mode: sync, steps: 40, seed: 3}}
summary: {{every_steps: 20, tensorboard: false}}
""", base_dir=".")


@pytest.fixture(scope="module")
def small_ids():
    rng = np.random.default_rng(11)
    n = 2400
    dense = rng.normal(size=(n, 3)).astype(np.float32)
    one = (rng.zipf(1.3, n) - 1) % 400
    lengths = rng.integers(0, 4, n)
    many = (rng.zipf(1.3, int(lengths.sum())) - 1) % 400
    weights = rng.random(int(lengths.sum())).astype(np.float32) + 0.5
    y = (one % 3 == 0).astype(np.float32)
    return dense, [(one, np.ones(n, np.int64), None), (many, lengths, weights)], y


def run_small(client, path, spec, data):
    dense, cats, y = data
    layout = record_layout(spec.model.features.model_dump())
    x = layout.pack(dense, [(i, n) for i, n, _ in cats], [w for _, _, w in cats])
    return dtrain.run(spec, client=client, run_dir=path,
                      data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))


@pytest.mark.parametrize("num_ps", [1, 2])
def test_a_table_without_a_vocabulary_trains_as_a_fixed_one_on_the_same_ids(inproc_client, tmp_path, small_ids,
                                                                            num_ps):
    """min_count 1 and no eviction: the rows of every id seen, and the MLPs, equal a fixed table's
    run (its rows start per id as the dynamic table's do), whatever the ps count; model.pt holds the
    ids and their rows and loads into build_model(spec)."""
    fixed = run_small(inproc_client, tmp_path / "fixed", small_ids_spec(1, None), small_ids)
    spec = small_ids_spec(num_ps, "max_rows: 1000")
    dyn = run_small(inproc_client, tmp_path / "dyn", spec, small_ids)
    assert dyn.summary["status"] == "completed"
    for t in ("C1", "C2"):
        table = dyn.model.tables[t]
        ids = table.row_ids
        assert 50 < len(ids) <= 400 and bool((ids[1:] > ids[:-1]).all())
        assert float((table.weight - fixed.model.tables[t].weight[ids]).detach().abs().max()) <= 1e-6
        figures = dyn.summary["tables"][t]
        assert figures["live_rows"] == len(ids) == figures["admitted"] and figures["evicted"] == 0
        assert len(figures["parts"]) == num_ps
    for mine, theirs in ((dyn.model.top, fixed.model.top), (dyn.model.bottom, fixed.model.bottom)):
        assert max(float((a - b).detach().abs().max()) for a, b in zip(mine.parameters(), theirs.parameters(),
                                                                        strict=True)) <= 1e-6
    state = torch.load(tmp_path / "dyn" / "model.pt", weights_only=True)
    served = dtrain.build_model(spec)
    served.load_state_dict(state)
    assert torch.equal(served.tables["C1"].row_ids, dyn.model.tables["C1"].row_ids)
    x = torch.from_numpy(record_layout(spec.model.features.model_dump()).pack(
        small_ids[0][:64], [(i, n) for i, n, _ in [(c[0][:64], c[1][:64], None) if k == 0 else
                                                    (c[0][:int(c[1][:64].sum())], c[1][:64], None)
                                                    for k, c in enumerate(small_ids[1])]],
        [None, small_ids[1][1][2][:int(small_ids[1][1][1][:64].sum())]]))
    with torch.no_grad():
        assert torch.allclose(served(x), dyn.model(x), atol=1e-6)


def test_the_row_cap_holds_evicts_and_still_learns(inproc_client, tmp_path, small_ids):
    """max_rows below the distinct ids: every ps part stays under its share, rows are evicted and
    counted, and the model still learns (held-out AUC well above chance)."""
    spec = small_ids_spec(2, "max_rows: 60")
    result = run_small(inproc_client, tmp_path / "run", spec, small_ids)
    assert result.summary["status"] == "completed"
    for t in ("C1", "C2"):
        figures = result.summary["tables"][t]
        assert figures["evicted"] > 0 and figures["live_rows"] <= 60
        assert all(p["live_rows"] <= 30 and p["capacity"] <= 30 for p in figures["parts"].values())
        assert figures["admitted"] - figures["evicted"] == figures["live_rows"]
    assert result.summary["eval"]["auc"] > 0.7


def test_min_count_keeps_rare_ids_out(inproc_client, tmp_path, small_ids):
    spec = small_ids_spec(1, "max_rows: 1000, min_count: 5")
    result = run_small(inproc_client, tmp_path / "run", spec, small_ids)
    everyone = run_small(inproc_client, tmp_path / "all", small_ids_spec(1, "max_rows: 1000"), small_ids)
    rare, common = result.summary["tables"]["C1"], everyone.summary["tables"]["C1"]
    assert rare["live_rows"] < common["live_rows"] and rare["rejected"] > 0 and common["rejected"] == 0


def test_tables_too_large_for_model_pt_stay_in_the_checkpoints(inproc_client, tmp_path, raw, monkeypatch):
    """Past the size the chief assembles, model.pt holds the dense parameters only (no table is
    pulled whole into the chief), and the final evaluation still reads the rows from the ps."""
    from dtrain.chief import evaluation

    spec = rec_spec(2)
    monkeypatch.setattr(evaluation, "MODEL_PT_TABLE_BYTES", sum(TABLE_ROWS.values()) * 4 * 4 - 1)
    x, y = pack(spec, raw)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run",
                        data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))
    assert result.summary["status"] == "completed" and 0.5 < result.summary["eval"]["auc"] <= 1
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert not any(k.startswith("tables.") for k in state) and "top.0.weight" in state


def test_a_malformed_criteo_line_fails_the_run_naming_file_line_and_field_after_a_checkpoint(inproc_client,
                                                                                            tmp_path):
    """Criteo-layout files read by the replicas: a bad categorical on line 500 of the last file
    fails the run (exit 1 from the CLI) naming file, line and field; the last good step is
    checkpointed for --resume."""
    import importlib.util

    from dtrain.chief import checkpoint as ckpt
    from tests.helpers.paths import ROOT

    gen_spec = importlib.util.spec_from_file_location("make_criteo_like", ROOT / "examples" / "make_criteo_like.py")
    gen = importlib.util.module_from_spec(gen_spec)
    gen_spec.loader.exec_module(gen)
    files = gen.generate(tmp_path / "data", rows=5000, files=5, seed=1, gzip=False)
    (tmp_path / "train").mkdir()
    for f in files[:4]:
        f.rename(tmp_path / "train" / f.name)
    cats = ", ".join(f"{{name: C{i}}}" for i in range(1, 27))
    tables = ", ".join(f"C{i}: {{num_embeddings: 1000, dim: 4}}" for i in range(1, 27))
    spec = dtrain.loads(f"""
name: criteo-bad-line
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  features: {{dense: [I1, I2, I3], categorical: [{cats}]}}
  tables: {{{tables}}}
  dlrm: {{bottom: [4], top: [1]}}
  loss: bce_with_logits
data: {{source: "{tmp_path}/train/", eval_source: "{files[4]}", batch_size: 100, epochs: 1, shuffle: false,
       readers: 1, prefetch: 1, shuffle_buffer: 200}}
optimizer: {{name: adagrad, lr: 0.05}}
training: {{mode: sync, seed: 0}}
checkpoint: {{every_steps: 2}}
summary: {{tensorboard: false}}
""")
    from dtrain.chief.inputs import file_input

    plan = dtrain.compile(spec, data=file_input(spec, with_stats=False))
    bad = Path(plan.data.replicas[0].parts[-1].path)  # the file replica 0 reads last
    assert len(plan.data.replicas[0].parts) == 2
    lines = bad.read_text().split("\n")
    fields = lines[499].split("\t")
    fields[16] = "zz12"  # C3
    lines[499] = "\t".join(fields)
    bad.write_text("\n".join(lines))
    with pytest.raises(dtrain.RunError, match=rf"{bad.name}:500: C3: 'zz12' is not a hexadecimal id"):
        dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    latest = ckpt.latest(tmp_path / "run")  # (one reader, a small window: the bad file is read late)
    summary = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())
    assert latest is not None and latest.step == summary["global_step"] >= 2


# ------------------------------------------------------------------------------ a module fed by features

def module_spec(num_ps: int) -> dtrain.PipelineSpec:
    return dtrain.loads(f"""
name: feature-module
cluster: {{jobs: {{ps: {num_ps}, worker: 2}}}}
model:
  module: tests.helpers.models:FeatureNet
  features:
    dense: [I1, I2, I3]
    categorical: [{{name: C1, table: emb.a}}, {{name: C2, table: emb.b, max_ids: 3, weighted: true}},
                  {{name: C3, table: emb.a, max_ids: 2}}]
  loss: bce_with_logits
data: {{batch_size: {BATCH}, shuffle: false, test_fraction: 0.1}}
optimizer: {{name: adagrad, lr: 0.1}}
training: {{mode: sync, steps: {STEPS}, seed: 3}}
summary: {{every_steps: 25, tensorboard: false}}
""", base_dir=".")


@pytest.mark.parametrize("num_ps", [1, 2])
def test_a_module_fed_by_features_matches_single_process_torch_without_a_record_pass(inproc_client, tmp_path,
                                                                                   num_ps, monkeypatch):
    """forward(dense, features) on the replicas, its bags as ps tables, equals the same module
    trained by plain torch (sparse Adagrad) on the same batches; no record pass runs."""
    from dtrain.worker import tables as worker_tables
    from tests.helpers.models import FeatureNet

    rng = np.random.default_rng(5)
    dense = rng.normal(size=(ROWS, 3)).astype(np.float32)
    spans = [(300, 1), (97, 3), (300, 2)]
    cats = []
    for rows, max_ids in spans:
        lengths = rng.integers(0, max_ids + 1, ROWS) if max_ids > 1 else np.ones(ROWS, np.int64)
        ids = (rng.zipf(1.4, int(lengths.sum())) - 1) % rows
        cats.append((ids.astype(np.int64), lengths, rng.random(int(lengths.sum())).astype(np.float32) + 0.5))
    y = ((cats[0][0] % 4) < 2).astype(np.float32)
    spec = module_spec(num_ps)
    layout = record_layout(spec.model.features.model_dump())
    x = layout.pack(dense, [(i, n) for i, n, _ in cats], [None, cats[1][2], None])

    def no_record_pass(*args, **kwargs):
        raise AssertionError("a record pass ran")

    monkeypatch.setattr(worker_tables, "ids_of", no_record_pass)
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run",
                        data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))
    assert result.summary["status"] == "completed"
    assert sorted(t.name for t in result.plan.tables) == ["emb.a.weight", "emb.b.weight"]
    mine = replica_rows(result.plan, 200)
    reference = FeatureNet()
    reference.load_state_dict(dtrain.build_model(spec).state_dict())  # the same names: model.pt loads into it
    opts = [torch.optim.Adagrad([p for n, p in reference.named_parameters() if n.startswith("emb.")], lr=0.1),
            torch.optim.Adagrad(reference.head.parameters(), lr=0.1)]
    starts = [np.concatenate([[0], np.cumsum(n)]) for _, n, _ in cats]
    for step in range(STEPS):
        rows = np.concatenate([r[step * BATCH:(step + 1) * BATCH] for r in mine])
        feats = {}
        for name, (ids, _, w), start in zip(("C1", "C2", "C3"), cats, starts, strict=True):
            pieces = [np.arange(start[r], start[r + 1]) for r in rows]
            flat = np.concatenate(pieces).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])[:-1]])
            feats[name] = (torch.from_numpy(ids[flat]), torch.from_numpy(offsets).long(),
                           torch.from_numpy(w[flat]) if name == "C2" else None)
        for opt in opts:
            opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(
            reference(torch.from_numpy(dense[rows]), feats), torch.from_numpy(y[rows])).backward()
        for opt in opts:
            opt.step()
    assert reference.emb["a"].weight.grad.is_sparse
    got, want = dict(result.model.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).detach().abs().max()) for k in got) <= TOLERANCE
    assert float((got["emb.a.weight"] - dtrain.build_model(spec).emb["a"].weight).detach().abs().max()) > 1e-3


def test_a_features_table_that_the_module_lacks_is_refused(tmp_path):
    spec = module_spec(1)
    bad = spec.model_dump(mode="json")
    bad["model"]["features"]["categorical"][0]["table"] = "emb.c"
    with pytest.raises(ValueError, match="feature 'C1' looks up 'emb.c', which is not one of the module's sparse "
                                         "embeddings \\(emb.a, emb.b\\)"):
        dtrain.build_model(dtrain.PipelineSpec.model_validate(bad))


@pytest.mark.parametrize(("dynamic", "resume_ps"), [("max_rows: 1000", 3), ("max_rows: 1000", 1),
                                                   ("max_rows: 1000", 2), (None, 2), (None, 3)])
def test_tables_resume_onto_any_ps_count_keeping_every_row(inproc_client, tmp_path, small_ids, dynamic, resume_ps):
    """Checkpointed at step 20 by 2 ps tasks, resumed to step 40 by 3, 1 or 2: every id's row and
    its Adagrad state move to the task that holds the id now (2: each task reads its own part of
    the checkpoint, with the rows of fixed tables not drawn yet still undrawn), and training goes
    on exactly as an uninterrupted run's (sync, fixed seed; rows start per id)."""
    def spec(num_ps, steps, ckpt=""):
        s = small_ids_spec(num_ps, dynamic)
        data = s.model_dump(mode="json")
        data["training"]["steps"] = steps
        if ckpt:
            data["checkpoint"] = {"every_steps": 10, "keep": 3}
        return dtrain.PipelineSpec.model_validate(data)

    ref = run_small(inproc_client, tmp_path / "ref", spec(2, 40), small_ids)
    run_small(inproc_client, tmp_path / "run", spec(2, 20, ckpt="yes"), small_ids)
    resumed_spec = spec(resume_ps, 40, ckpt="yes")
    layout = record_layout(resumed_spec.model.features.model_dump())
    dense, cats, y = small_ids
    x = layout.pack(dense, [(i, n) for i, n, _ in cats], [w for _, _, w in cats])
    resumed = dtrain.run(resumed_spec, client=inproc_client, run_dir=tmp_path / "run", resume=True,
                         data=(da.from_array(x, chunks=(200, x.shape[1])), da.from_array(y, chunks=200)))
    assert resumed.summary["start_step"] == 20 and resumed.summary["global_step"] == 40
    for t in ("C1", "C2"):
        a, b = resumed.model.tables[t], ref.model.tables[t]
        if dynamic:
            assert torch.equal(a.row_ids, b.row_ids)
        assert float((a.weight - b.weight).detach().abs().max()) <= 1e-6
        figures = resumed.summary["tables"][t]
        assert len(figures["parts"]) == resume_ps
        if dynamic:  # (the counters come once, summed: not lost, not counted twice)
            assert figures["live_rows"] == len(a.row_ids)
            assert [figures[k] for k in ("admitted", "evicted", "rejected")] == [
                ref.summary["tables"][t][k] for k in ("admitted", "evicted", "rejected")]
    if (dynamic, resume_ps) == ("max_rows: 1000", 3):  # the comparison has teeth: step 20's rows differ
        mid = run_small(inproc_client, tmp_path / "mid", spec(2, 20), small_ids)
        assert float((mid.model.tables["C1"].weight - ref.model.tables["C1"].weight[
            torch.searchsorted(ref.model.tables["C1"].row_ids, mid.model.tables["C1"].row_ids)]).detach().abs().max()
        ) > 1e-3


def test_a_dumped_recommendation_spec_validates_again():
    """A checkpoint keeps the spec as dumped (every default written out): it must load back."""
    for spec in (small_ids_spec(2, "max_rows: 1000, min_count: 2"), small_ids_spec(1, None), rec_spec(2)):
        again = dtrain.PipelineSpec.model_validate(spec.model_dump(mode="json"))
        assert again.model.tables == spec.model.tables
