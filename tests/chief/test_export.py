"""``dtrain export`` and ``dtrain.serving.ExportedModel``: a trained DLRM (a fixed table folded by
modulo, most of whose rows were never drawn, and a table without a vocabulary over two ps tasks)
exported from its checkpoint predicts exactly what the trained model predicts on held-out records,
its tables memory-mapped; a run directory without checkpoints, a step it lacks, and an output
directory in use are refused with one line and exit 2, nothing written."""

from __future__ import annotations

import json

import dask.array as da
import numpy as np
import pytest
import torch

import dtrain
from dtrain.cli import main
from dtrain.model.recommendation import record_layout
from dtrain.serving import ExportedModel
from tests.helpers.pipelines import dlrm_yaml

SPEC = dlrm_yaml(
    "export-dlrm", categorical=[{"name": "C1"}, {"name": "C2", "max_ids": 3, "weighted": True}],
    tables={"C1": {"num_embeddings": 5000, "dim": 4, "init_std": 0.3},
            "C2": {"dim": 4, "init_std": 0.3, "max_rows": 1000, "storage": "bfloat16",
                   "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}},
    training={"mode": "sync", "steps": 30, "seed": 5}, checkpoint={"every_steps": 10})


def records(spec: dtrain.PipelineSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 2)).astype(np.float32)
    one = rng.zipf(1.5, n) * 7919  # ids far above C1's 5000 rows: folded by modulo
    lengths = rng.integers(0, 4, n)
    many = rng.zipf(1.3, int(lengths.sum())) * 104_729
    weights = rng.random(int(lengths.sum())).astype(np.float32) + 0.5
    layout = record_layout(spec.model.features.model_dump())
    x = layout.pack(dense, [(one, np.ones(n, np.int64)), (many, lengths)], [None, weights])
    return x, ((one % 3 == 0) ^ (dense[:, 0] > 0)).astype(np.float32)


@pytest.fixture(scope="module")
def trained(inproc_client, tmp_path_factory):
    spec = dtrain.loads(SPEC, base_dir=".")
    x, y = records(spec, 2000, 0)
    run_dir = tmp_path_factory.mktemp("export") / "run"
    result = dtrain.run(spec, client=inproc_client, run_dir=run_dir,
                        data=(da.from_array(x, chunks=(500, x.shape[1])), da.from_array(y, chunks=500)))
    assert result.summary["status"] == "completed" and result.summary["checkpoints"][-1] == "ckpt-00000030"
    return spec, run_dir, result.model


def test_the_export_predicts_what_the_trained_model_predicts(trained, tmp_path, capsys):
    spec, run_dir, model = trained
    out = tmp_path / "served"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert "exported step 30 (ckpt-00000030)" in capsys.readouterr().out
    index = json.loads((out / "export.json").read_text())
    assert index["tables"]["tables.C1.weight"] == {"kind": "fixed", "file": "tables/tables.C1.npy", "rows": 5000,
                                                   "dim": 4}
    live = json.loads((run_dir / "summary.json").read_text())["tables"]["C2"]["parts"]
    assert [p["count"] for p in index["tables"]["tables.C2.weight"]["parts"]] == [
        live[f"/job:ps/task:{i}"]["live_rows"] for i in range(2)]  # every live row, on its part
    served = ExportedModel(out)
    assert isinstance(served._tables["tables.C1.weight"], np.memmap)  # mapped, not read
    x, _ = records(spec, 300, 1)  # held-out records: ids the training never saw among them
    xt = torch.from_numpy(x)
    model.eval()
    with torch.no_grad():
        expected = model(xt)
    torch.testing.assert_close(served.predict(xt), expected, rtol=0, atol=1e-6)
    # Rows read directly: an id the dynamic table never admitted reads zeros; a fixed row is the
    # trained one (drawn or not).
    assert torch.equal(served.lookup("tables.C2.weight", torch.tensor([3])), torch.zeros(1, 4))
    torch.testing.assert_close(served.lookup("tables.C1.weight", torch.tensor([0, 4999])),
                               model.tables["C1"].weight.detach()[[0, 4999]], rtol=0, atol=0)


def test_an_older_step_and_bad_requests(trained, tmp_path, capsys):
    spec, run_dir, _ = trained
    assert main(["export", str(run_dir), str(tmp_path / "at20"), "--step", "20"]) == 0
    assert ExportedModel(tmp_path / "at20").step == 20
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "x"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint of step 7 (it has 10, 20, 30)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # nothing written
    assert main(["export", str(run_dir), str(tmp_path / "at20")]) == 2  # in use
    assert "is not empty" in capsys.readouterr().err
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert main(["export", str(empty), str(tmp_path / "y")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_the_documented_serving_example_runs(trained, tmp_path):
    """docs/recommendation.md's example, run on a real export (fails when the documented calls or
    names drift from the loader's)."""
    from tests.helpers.paths import ROOT

    spec, run_dir, _ = trained
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out)]) == 0
    text = (ROOT / "docs" / "recommendation.md").read_text()
    section = text[text.index("## Serving an export"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    x, _ = records(spec, 50, 2)
    scope = {"x": torch.from_numpy(x)}
    exec(compile(code.replace('"exported/"', repr(str(out))), "recommendation.md", "exec"), scope)
    assert scope["rows"].shape == (2, 4) and scope["logits"].shape == (50, 1)
