"""What `dtrain plan` and `dtrain run` refuse before anything starts (review M13, M9, L6): the
user's code is imported, the data read and checked against the model, and the plan's ps memory
compared with the embedded workers' limit. Exit 2 with `FILE:LINE: path: message`; no cluster is
started and nothing is written. `dtrain validate` (which never imports nor reads) still says ok."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dtrain
from dtrain import cli
from dtrain.chief import runner
from dtrain.chief.preflight import ps_state_bytes
from dtrain.ps.shard import ParameterShard
from dtrain.spec.errors import SpecError

MLP = """\
name: pre
cluster: {jobs: {ps: 1, worker: 1}}
model:
  input_shape: [4]
  layers:
    - {type: linear, out: 3}
data:
  source: d.npz
training: {steps: 5}
"""


def write(tmp_path: Path, text: str, x: np.ndarray | None = None, y: np.ndarray | None = None) -> Path:
    if x is not None:
        np.savez(tmp_path / "d.npz", x=x, y=y)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def cmd(capsys, *args: str) -> tuple[int, list[str]]:
    code = cli.main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_cluster(monkeypatch):
    """`run` must fail before it connects: connecting (starting or joining a cluster) is an error."""
    def connect(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(runner, "connect", connect)
    monkeypatch.setattr(cli, "_setup_logging", lambda quiet=False: None)


def xy(n: int = 40, features: int = 4, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, features)).astype(np.float32), np.arange(n) % classes


# --------------------------------------------------------------------------------- the user's code


@pytest.mark.parametrize(("module", "message"), [
    ("tests.helpers.models:Missing", "'tests.helpers.models:Missing' cannot be imported: 'tests.helpers.models:Missing': "
                                     "'tests.helpers.models' has no attribute 'Missing'"),
    ("os:getcwd", "'os:getcwd' is not an nn.Module class or factory: 'os:getcwd' returned str"),
    ("tests.helpers.hooks:CALLS", "'tests.helpers.hooks:CALLS' is not an nn.Module class or factory"),
    ("tests.helpers.models:TinyMLP", None),
])
def test_plan_imports_the_module_and_reports_it_at_model_module(tmp_path, capsys, module, message):
    path = write(tmp_path, f"name: m\nmodel:\n  module: {module}\ndata: {{source: sklearn:digits}}\n")
    assert cmd(capsys, "validate", str(path)) == (0, [])  # validate only looks the module up
    code, err = cmd(capsys, "plan", str(path))
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{path}:3: model.module: {message}"), err


def test_a_module_that_raises_on_import_is_a_spec_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "raising_models.py").write_text("raise RuntimeError('no GPU driver here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "model: {module: 'raising_models:Net'}\n")
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and err == [f"{path}:1: model.module: 'raising_models:Net' failed while importing or building "
                                 "the model: RuntimeError: no GPU driver here"]


def test_plan_builds_custom_hooks(tmp_path, capsys):
    path = write(tmp_path, MLP.replace("source: d.npz", "source: sklearn:iris") + "hooks:\n  - {type: logging}\n"
                 "  - {type: 'tests.helpers.hooks:NotAHook'}\n")
    assert cmd(capsys, "validate", str(path))[0] == 0
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:12: hooks[1].type: custom hook "), err
    assert "not a subclass of dtrain.Hook" in err[0]


def test_run_with_an_unimportable_module_exits_2_and_starts_nothing(tmp_path, capsys, no_cluster):
    path = write(tmp_path, "name: m\nmodel:\n  module: tests.helpers.models:Nope\ndata: {source: sklearn:digits}\n")
    run_dir = tmp_path / "run"
    code, err = cmd(capsys, "run", str(path), "--run-dir", str(run_dir), "--quiet")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:3: model.module: "), err
    assert "has no attribute 'Nope'" in err[0]
    assert not run_dir.exists()


def test_python_api_run_checks_before_connecting(tmp_path, no_cluster):
    spec = dtrain.loads("model: {module: 'os:getcwd'}\n")
    with pytest.raises(SpecError, match=r"model.module: 'os:getcwd' is not an nn.Module"):
        dtrain.run(spec, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------- data and model fit


def test_labels_out_of_range_for_the_outputs(tmp_path, capsys, no_cluster):
    x, y = xy()
    y[[0, 5]] = 1_000_000  # before: silently 1000001 classes, then "Target out of bounds" in every replica
    path = write(tmp_path, MLP, x, y)
    assert cmd(capsys, "validate", str(path))[0] == 0
    for args in (("plan", str(path)), ("run", str(path), "--run-dir", str(tmp_path / "run"))):
        code, err = cmd(capsys, *args)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"{path}:8: data.source: 'd.npz': its labels run up to 1000000, so they are "
                                 "1000001 classes"), err
        assert "but model.layers[0].out gives 3 outputs per example: use labels 0..2, or make the model output " \
               "1000001" in err[0]
    assert not (tmp_path / "run").exists()


def test_feature_count_must_match_input_shape(tmp_path, capsys):
    x, y = xy(features=5)
    path = write(tmp_path, MLP, x, y)
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and err == [f"{path}:8: data.source: the examples of 'd.npz' have shape (5,) (5 features) but "
                                 "model.input_shape is [4]: set model.input_shape: [5]"]


def test_custom_module_is_run_on_meta_with_the_datas_shape(tmp_path, capsys):
    path = write(tmp_path, "model:\n  module: tests.helpers.models:TinyMLP\n  kwargs: {features: 67}\n"
                 "data: {source: sklearn:digits}\n")
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{path}:2: model.module: 'tests.helpers.models:TinyMLP' fails on the examples of "
                             "'sklearn:digits', of shape (64,): RuntimeError: "), err  # torch's meta shape error
    # Too few outputs for the data's classes: named at the module, whose output it is.
    path.write_text("model:\n  module: tests.helpers.models:TinyMLP\n  kwargs: {classes: 4}\n"
                    "data: {source: sklearn:digits}\n")
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "its labels run up to 9, so they are 10 classes" in err[0]
    assert "model.module 'tests.helpers.models:TinyMLP' gives 4 outputs" in err[0]


def test_float_targets_with_cross_entropy(tmp_path, capsys):
    x, _ = xy()
    path = write(tmp_path, MLP, x, np.linspace(0, 1, len(x)))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "are not integer class labels (read as a regression target) but model.loss is " \
                          "cross_entropy" in err[0]


def test_non_finite_data_is_refused_before_start(tmp_path, capsys):
    x, y = xy()
    x[3, 1] = np.inf
    path = write(tmp_path, MLP, x, y)
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:8: data.source: cannot load 'd.npz': ")
    assert "x[3, 1] is inf (row 3, column 1;" in err[0]


# ------------------------------------------------------------------------------------------ memory


def test_a_ps_task_that_cannot_fit_its_memory_limit_is_refused(tmp_path, capsys):
    text = """\
name: huge
cluster: {jobs: {ps: 2, worker: 1}, memory_limit: 1GiB}
model:
  input_shape: [64]
  layers: [{type: linear, out: 2000000}, {type: linear, out: 10}]
data: {source: sklearn:digits}
optimizer: {name: adam}
"""
    path = write(tmp_path, text)
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 1, err  # round robin: both weights on ps task 0, the biases on task 1
    weights = (64 * 2_000_000 + 2_000_000 * 10) * 4
    assert err[0].startswith(f"{path}:2: cluster.memory_limit: ps task /job:ps/task:0 needs at least "
                             f"{5 * weights} bytes ({weights} bytes of parameters, with their scratch "
                             "buffer and adam state), more than its worker's memory_limit '1GiB' (1073741824 bytes)")
    # Sync: a step's gradient sum on top.
    path.write_text(text + "training: {mode: sync}\n")
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and f"needs at least {6 * weights} bytes" in err[0] and "with their gradient sum, scratch" in err[0]
    path.write_text(text)
    # Not without a limit; on a running cluster (its workers have their own limits) the key is refused.
    path.write_text(text.replace("memory_limit: 1GiB", "memory_limit: 1GiB, scheduler: tcp://127.0.0.1:1"))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "cluster.memory_limit: memory_limit applies to the embedded cluster" in err[0], err
    path.write_text(text.replace("memory_limit: 1GiB", "memory_limit: '0'"))
    assert cmd(capsys, "plan", str(path))[0] == 0


@pytest.mark.parametrize("optimizer", [
    {"name": "sgd", "lr": 0.1}, {"name": "momentum", "lr": 0.1, "momentum": 0.9}, {"name": "adam"},
    {"name": "adam", "amsgrad": True}, {"name": "adagrad"}])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ps_state_bytes_counts_what_a_shard_allocates(optimizer, mode):
    """Sync shards hold a step's gradient sum that async ones do not (fails if either count drifts
    from what a real shard allocates)."""
    numel = 1000
    spec = dtrain.PipelineSpec.model_validate({"model": {"input_shape": [4], "layers": [{"type": "linear", "out": 2}]},
                                               "optimizer": optimizer}).optimizer
    config = {"index": 0, "mode": mode, "steps": 10, "optimizer": spec.model_dump()}  # as ShardGroup passes it
    shard = ParameterShard(config, torch.zeros(numel))
    shard.core.optimizer.step(shard.param, torch.ones(numel))  # momentum's buffer is made by the first step
    tensors = [v for obj in (shard.core, shard.gradients, shard.core.optimizer) for v in vars(obj).values()
               if isinstance(v, torch.Tensor)]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    sync = mode == "sync"
    assert ps_state_bytes(numel * 4, spec, sync=sync) == allocated
    config["moving_average"] = {"decay": 0.99}  # training.moving_average: one more buffer
    averaged = ParameterShard(config, torch.zeros(numel))
    assert averaged.core.averages is not None
    assert ps_state_bytes(numel * 4, spec, averages=True, sync=sync) == allocated + averaged.core.averages.shadow.nbytes


def test_compile_errors_get_their_file_and_line(tmp_path, capsys):
    """The compiler's own spec errors (a pin that names no parameter) used to print '<spec>:1:'."""
    path = write(tmp_path, MLP.replace("source: d.npz", "source: sklearn:iris")
                 + "placement:\n  variable_devices: {0.wieght: /job:ps/task:0}\n")
    code, err = cmd(capsys, "plan", str(path), "--set", "training.steps=7")
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:11: placement.variable_devices.0.wieght: "
                                                             "'0.wieght' names no parameter of the model"), err


# ---------------------------------------------------------------------------- sparse embedding tables

CTR = """\
name: ids
cluster: {jobs: {ps: 2, worker: 1}}
model:
  input_shape: [3]
  layers:
    - {type: embedding, num_embeddings: 50, dim: 4}
    - {type: flatten}
    - {type: linear, out: 1}
  loss: bce_with_logits
data:
  source: d.npz
optimizer: {name: adagrad, lr: 0.1}
training: {steps: 5}
"""


def ids_xy(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 50, (n, 3)).astype(np.int32), np.arange(n) % 2


def test_ids_outside_the_table_are_refused_before_start(tmp_path, capsys, no_cluster):
    x, y = ids_xy()
    x[7, 2] = 50  # one past the table; before: an index error in a replica (or the ps) after start-up
    x[9, 0] = -3
    path = write(tmp_path, CTR, x, y)
    for args in (("plan", str(path)), ("run", str(path), "--run-dir", str(tmp_path / "run"))):
        code, err = cmd(capsys, *args)
        assert code == 2 and len(err) == 1, err
        assert err[0] == (f"{path}:11: data.source: cannot load 'd.npz': {tmp_path / 'd.npz'}: row 7, field 2 holds "
                          "id 50, outside the embedding table's 50 rows (ids 0..49; 2 such id(s)): raise "
                          "num_embeddings or map the ids into the table (e.g. id % num_embeddings)")
    assert not (tmp_path / "run").exists()
    x[7, 2], x[9, 0] = 49, 0
    write(tmp_path, CTR, x, y)
    assert cmd(capsys, "plan", str(path))[0] == 0


def test_float_features_for_an_embedding_model_are_refused(tmp_path, capsys, no_cluster):
    x, y = ids_xy()
    path = write(tmp_path, CTR, x.astype(np.float64), y)
    code, err = cmd(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:11: data.source: cannot load 'd.npz': ")
    assert "model.layers[0] is an embedding table, which takes integer ids, but its features are " \
           "float64" in err[0]
    path.write_text(CTR.replace("source: d.npz", "source: synthetic"))  # no file read: validation says so
    code, err = cmd(capsys, "validate", str(path))
    assert code == 2 and len(err) == 1 and err[0].startswith(f"{path}:11: data.source: 'synthetic' has float "
                                                             "features, but model.layers[0] is an embedding table")
    assert not (tmp_path / "run").exists()


def test_integer_csv_columns_are_ids_and_integer_npz_features_stay_numbers_for_dense_models(tmp_path, capsys):
    x, y = ids_xy()
    lines = ["a,b,c,label"] + [f"{r[0]},{r[1]},{r[2]},{t}" for r, t in zip(x, y, strict=True)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    path = write(tmp_path, CTR.replace("d.npz", "d.csv"))
    assert cmd(capsys, "plan", str(path))[0] == 0
    from dtrain.worker.replica import dataset_for

    data = dataset_for(dtrain.load(path))
    assert data.x_train.dtype == np.int64 and data.mean is None
    assert sorted(map(tuple, np.concatenate([data.x_train, data.x_test]))) == sorted(map(tuple, x.astype(np.int64)))
    dense = dataset_for(dtrain.load(write(tmp_path, MLP.replace("input_shape: [4]", "input_shape: [3]")
                                           .replace("out: 3", "out: 2"), x, y)))
    assert dense.x_train.dtype == np.float32 and dense.mean is not None  # standardised as before


def test_ps_memory_counts_table_rows_with_their_row_state(tmp_path, capsys):
    text = CTR.replace("num_embeddings: 50", "num_embeddings: 8000000").replace(
        "{jobs: {ps: 2, worker: 1}}", "{jobs: {ps: 2, worker: 1}, memory_limit: 100MiB}")
    path = write(tmp_path, text, *ids_xy())
    code, err = cmd(capsys, "plan", str(path))
    rows = 4_000_000 * 4 * 4  # each ps task holds half the rows; adagrad keeps one accumulator per row
    assert code == 2 and len(err) == 2, err  # ps 0 also holds the linear weight (12 floats), ps 1 its bias
    assert err[0] == (f"{path}:2: cluster.memory_limit: ps task /job:ps/task:0 needs at least {2 * rows + 4 * 48} "
                      "bytes (48 bytes of dense parameters with their scratch buffer and adagrad state, and "
                      f"{2 * rows} bytes of sparse table rows with their row optimizer state; the largest table on "
                      f"it, 0.weight, holds {2 * rows} bytes there: 4000000 rows of 4 in float32 with adagrad "
                      "state), more than its worker's memory_limit '100MiB' (104857600 bytes): raise "
                      "cluster.memory_limit or add ps tasks (a table's rows are split over all of them)"), err
    # 200 MiB holds the rows and their accumulators (the dense buffers' 4x would need 256 MB)
    path.write_text(path.read_text().replace("100MiB", "200MiB"))
    assert cmd(capsys, "plan", str(path))[0] == 0


def test_a_modules_tables_get_the_sparse_checks_before_start(tmp_path, capsys, no_cluster):
    module = CTR.replace("""  input_shape: [3]
  layers:
    - {type: embedding, num_embeddings: 50, dim: 4}
    - {type: flatten}
    - {type: linear, out: 1}
""", "  module: tests.helpers.models:TinyEmbedding\n")
    path = write(tmp_path, module.replace("{name: adagrad, lr: 0.1}", "{name: momentum, lr: 0.1}"), *ids_xy())
    code, err = cmd(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{path}:8: optimizer.name: momentum does not apply to sparse gradients"), err
    path.write_text(module.replace("TinyEmbedding", "TinyEmbedding\n  kwargs: {padding_idx: 0}"))
    code, err = cmd(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{path}:4: model.module: 'tests.helpers.models:TinyEmbedding' failed while importing or "
                             "building the model: ValueError: emb: a sparse Embedding with padding_idx is not "
                             "supported as a ps table"), err
    path.write_text(module)
    assert cmd(capsys, "plan", str(path))[0] == 0
    assert not (tmp_path / "run").exists()


def test_a_regression_module_may_return_one_value_per_sample(tmp_path, capsys, inproc_client):
    """(batch,) is accepted for mse like (batch, 1), and it trains; (batch, 3) is refused naming the fix."""
    x, _ = xy()
    path = write(tmp_path, "name: flat\ncluster: {jobs: {ps: 1, worker: 1}}\nmodel:\n  module: tests.helpers.models:Flat\n"
                 "  loss: mse\ndata: {source: d.npz, task: regression}\ntraining: {steps: 20}\n"
                 "optimizer: {name: sgd, lr: 0.05}\nsummary: {tensorboard: false}\n",
                 x, (x @ np.arange(4.0)).astype(np.float32))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 0, err
    result = dtrain.run(dtrain.load(path), client=inproc_client, run_dir=tmp_path / "run")
    # trained: far below the targets' variance (about 14), which a constant prediction would score
    assert result.summary["status"] == "completed" and result.summary["eval"]["loss"] < 7.0
    path.write_text(path.read_text().replace("Flat", "TinyMLP").replace("  loss: mse", "  kwargs: {features: 4, "
                                                                             "classes: 3}\n  loss: mse"))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "mse needs the model to output one value per sample, (batch,) or (batch, 1), but it " \
                         "outputs (batch, 3)" in err[0], err
COMPACT = CTR.replace("""  input_shape: [3]
  layers:
    - {type: embedding, num_embeddings: 50, dim: 4}
    - {type: flatten}
    - {type: linear, out: 1}
""", "  module: tests.helpers.models:CompactTable\n  kwargs: {vocab: VOCAB, storage: STORAGE, optimizer: OPT}\n").replace(
    "{jobs: {ps: 2, worker: 1}}", "{jobs: {ps: 2, worker: 1}, memory_limit: 100MiB}")


def compact(vocab: int, storage: str = "bfloat16", opt: str = "{name: rowwise_adagrad, lr: 0.1}") -> str:
    return COMPACT.replace("VOCAB", str(vocab)).replace("STORAGE", storage).replace("OPT", opt)


def test_ps_memory_counts_each_tables_storage_and_own_optimizer(tmp_path, capsys):
    """A bfloat16 table with rowwise_adagrad: 2 bytes an element and 4 bytes a row, not the run's
    adagrad in float32 (which would need 32 bytes a row of 4: refused at 100 MiB). Too large even
    so, the refusal names the table, its bytes on the task and the limit; `dtrain plan` shows the
    storage, the optimizer and the bytes with state."""
    path = write(tmp_path, compact(8_000_000), *ids_xy())
    code = cli.main(["plan", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("emb.weight  embedding 8000000x4  bfloat16  rowwise_adagrad (its own)  96000000 B (64000000 B rows + "
            "32000000 B state)  partition mod") in out, out
    assert "part 0 -> /job:ps/task:0  4000000 rows  48000000 B" in out
    path.write_text(compact(8_000_000, "float32", "{name: adagrad, lr: 0.1}"))  # the same table, uncompressed
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "the largest table on it, emb.weight, holds 128000000 bytes" in err[0], err
    path.write_text(compact(20_000_000))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 2, err
    part = 10_000_000 * (4 * 2 + 4)  # ps 0 also holds the linear weight (12 floats), ps 1 its bias
    assert err[0] == (f"{path}:2: cluster.memory_limit: ps task /job:ps/task:0 needs at least {part + 4 * 48} bytes "
                      f"(48 bytes of dense parameters with their scratch buffer and adagrad state, and {part} bytes "
                      "of sparse table rows with their row optimizer state; the largest table on it, emb.weight, "
                      f"holds {part} bytes there: 10000000 rows of 4 in bfloat16 with rowwise_adagrad state), more "
                      "than its worker's memory_limit '100MiB' (104857600 bytes): raise cluster.memory_limit or add "
                      "ps tasks (a table's rows are split over all of them), or make the table smaller: "
                      "Table(storage='bfloat16') halves its rows, a Table optimizer {name: rowwise_adagrad} keeps "
                      "one float of state per row"), err


def test_a_tables_own_optimizer_and_storage_are_checked_before_start(tmp_path, capsys):
    """A table with its own optimizer does not take the run's (momentum is fine for the dense
    layers then); a bad storage dtype or optimizer config is refused at model.module."""
    path = write(tmp_path, compact(50).replace("{name: adagrad, lr: 0.1}", "{name: momentum, lr: 0.1}"), *ids_xy())
    assert cmd(capsys, "plan", str(path))[0] == 0
    path.write_text(compact(50, opt="null").replace("{name: adagrad, lr: 0.1}", "{name: momentum, lr: 0.1}"))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "optimizer.name: momentum does not apply to sparse gradients" in err[0], err
    path.write_text(compact(50, storage="int8"))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"{path}:4: model.module: table emb.weight: storage 'int8' is not one of 'float32', 'bfloat16', 'float16'"), err
    path.write_text(compact(50, opt="{name: adam, lr: 0.1, weight_decay: 0.01}"))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and "table emb.weight: its optimizer" in err[0] and "not weight_decay" in err[0], err


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ps_state_bytes_counts_a_shards_compact_tables(mode):
    """With tables: ps_state_bytes of the plan's table bytes equals what a real shard allocates for
    its dense buffers and its table parts (bfloat16 rows, rowwise_adagrad's per-row accumulator)."""
    from dtrain.plan.tables import plan_tables, table_config
    from tests.helpers.models import CompactTable

    skeleton = CompactTable(vocab=1001, dim=6, optimizer={"name": "rowwise_adagrad", "lr": 0.1})
    (table,) = plan_tables([("emb.weight", skeleton.emb)], "ps", 2, "div", run_optimizer="adagrad")
    spec = dtrain.PipelineSpec.model_validate({"model": {"input_shape": [4], "layers": [{"type": "linear", "out": 2}]},
                                               "optimizer": {"name": "adagrad"}}).optimizer
    numel = 100
    shard = ParameterShard({"index": 0, "mode": mode, "steps": 10, "optimizer": spec.model_dump(),
                            "tables": [table_config(table, 0, seed=1)]}, torch.zeros(numel))
    part = shard.tables["emb.weight"]
    tensors = [v for obj in (shard.core, shard.gradients, shard.core.optimizer, part, part.optimizer) for v in vars(obj).values()
               if isinstance(v, torch.Tensor)]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert part.weight.dtype == torch.bfloat16
    assert ps_state_bytes(numel * 4, spec, table.parts[0].bytes, sync=mode == "sync") == allocated


def test_a_modules_own_embedding_init_is_declared_or_refused(tmp_path, capsys, inproc_client):
    """Factors near 0.1 and zero biases set by the module: without a declaration the run is refused
    naming each embedding and the fix; declared, the ps tables start exactly as declared."""
    rng = np.random.default_rng(0)
    x = np.stack([rng.integers(0, 30, 200), rng.integers(0, 20, 200)], 1).astype(np.int64)
    text = ("name: mf\ncluster: {jobs: {ps: 2, worker: 1}}\nmodel:\n  module: tests.helpers.models:Factors\n"
            "  kwargs: {declare: %s}\n  loss: mse\ndata: {source: d.npz, task: regression}\n"
            "optimizer: {name: adagrad, lr: 0.05, weight_decay: 0.001}\ntraining: {steps: 3}\n"
            "summary: {tensorboard: false}\n")
    path = write(tmp_path, text % "false", x, rng.normal(size=200).astype(np.float32))
    code, err = cmd(capsys, "plan", str(path))
    assert code == 2 and len(err) == 4, err
    assert err[0].startswith(f"{path}:4: model.module: users: the module initialises this sparse embedding itself "
                             "(std 0.1") and "self.users.dtrain_init = {'normal': 0.1" in err[0]
    assert any("user_bias: the module initialises this sparse embedding itself (all 0)" in e and
               "{'constant': 0.0}" in e for e in err)
    path.write_text(text % "true")
    assert cmd(capsys, "plan", str(path))[0] == 0
    spec = dtrain.load(path)
    model = dtrain.build_model(spec)  # the ps tables' initial values, as the ps tasks draw them
    assert float(model.user_bias.weight.detach().abs().max()) == 0.0
    assert 0.07 < float(model.users.weight.detach().std()) < 0.13
    result = dtrain.run(spec, client=inproc_client, run_dir=tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert float(result.model.users.weight.detach().std()) < 0.3  # trained from 0.1, not from normal(0, 1)
