"""Incremental checkpoints (``checkpoint.incremental``) of a DLRM on the in-process cluster: every
third checkpoint full and deltas between, with their chains in the manifests; retention keeps the
full checkpoint a kept delta needs; a resume from a delta restores (each ps task reading its own
chain) exactly the model the run ended with and goes on writing deltas; a resume onto three ps
tasks (each reading from every old part's chain the rows it owns), then onto one, and ``dtrain
export`` of a delta (the chain merged) predict exactly the same."""

from __future__ import annotations

import json

import dask.array as da
import numpy as np
import pytest
import torch

import dtrain
from dtrain.chief import checkpoint as ckpt
from dtrain.chief.export import export
from dtrain.model.recommendation import record_layout
from dtrain.serving import ExportedModel
from tests.helpers.pipelines import dlrm_yaml


def spec_text(ps: int = 2, steps: int = 40) -> str:
    return dlrm_yaml(
        "ckpt-deltas", jobs={"ps": ps, "worker": 2},
        categorical=[{"name": "C1"}, {"name": "C2", "max_ids": 3}, {"name": "C3"}],
        tables={"C1": {"num_embeddings": 5000, "dim": 4, "init_std": 0.3},
                "C2": {"dim": 4, "init_std": 0.3, "max_rows": 900, "ttl_steps": 8, "storage": "bfloat16",
                       "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}},
                "C3": {"num_embeddings": 3000, "dim": 4, "init_std": 0.3}},
        training={"mode": "sync", "steps": steps, "seed": 5},
        checkpoint={"every_steps": 10, "keep": 1, "incremental": {"full_every": 3}})


def spec(ps: int = 2, steps: int = 40) -> dtrain.PipelineSpec:
    return dtrain.loads(spec_text(ps, steps), base_dir=".")


def records(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, 2)).astype(np.float32)
    c1 = rng.zipf(1.4, n) * 7919
    lengths = rng.integers(0, 4, n)
    c2 = rng.zipf(1.3, int(lengths.sum())) * 104_729
    c3 = rng.zipf(1.6, n) * 31
    layout = record_layout(spec().model.features.model_dump())
    x = layout.pack(dense, [(c1, np.ones(n, np.int64)), (c2, lengths), (c3, np.ones(n, np.int64))], [None] * 3)
    return x, ((c1 % 3 == 0) ^ (dense[:, 0] > 0)).astype(np.float32)


def data() -> tuple[da.Array, da.Array]:
    x, y = records(4000, 0)
    return da.from_array(x, chunks=(1000, x.shape[1])), da.from_array(y, chunks=1000)


def predict(model: torch.nn.Module) -> torch.Tensor:
    x, _ = records(400, 1)  # held out: ids the training never saw among them
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x))


@pytest.fixture(scope="module")
def trained(inproc_client, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("deltas") / "run"
    result = dtrain.run(spec(), client=inproc_client, run_dir=run_dir, data=data())
    return run_dir, result


def manifest(run_dir, step: int) -> dict:
    return json.loads((ckpt.checkpoint_dir(run_dir) / f"ckpt-{step:08d}.json").read_text())


def test_full_every_third_and_deltas_between_retention_keeping_their_base(trained):
    run_dir, result = trained
    s = result.summary
    assert s["status"] == "completed" and s["checkpoints"] == [f"ckpt-{k:08d}" for k in (0, 10, 20, 30, 40)]
    assert s["checkpoint_deltas"] == 3  # 10, 20 and 40
    # keep: 1, but 40 is a delta of 30: both stay, nothing else.
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["ckpt-00000030", "ckpt-00000040"]
    full, delta = manifest(run_dir, 30), manifest(run_dir, 40)
    assert [p["kind"] for p in full["parts"]] == ["full", "full"] and full["depth"] == 0
    assert [(p["kind"], p["base"]) for p in delta["parts"]] == [("delta", 30), ("delta", 30)] and delta["depth"] == 1
    # Ten steps of 128 records touch a few hundred of the 8,000 fixed rows: the deltas are small.
    for f, d in zip(full["parts"], delta["parts"], strict=True):
        assert d["bytes"] < f["bytes"] / 4, (d, f)
    chain = ckpt.part_chain(ckpt.checkpoint_dir(run_dir) / "ckpt-00000040", delta["parts"][1])
    assert [(p.parent.name, p.name) for p, _, _ in chain] == [("ckpt-00000030", "shard-00001.pt"),
                                                            ("ckpt-00000040", "shard-00001.pt")]


def test_a_resume_from_a_delta_restores_the_model_exactly_and_goes_on_with_deltas(trained, inproc_client, tmp_path):
    import shutil

    run_dir, result = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    same = dtrain.run(spec(), client=inproc_client, run_dir=copy, resume=True, data=data())
    assert same.summary["start_step"] == 40
    assert torch.equal(predict(same.model), predict(result.model))  # bit for bit, every table and variable
    more = dtrain.run(spec(steps=50), client=inproc_client, run_dir=copy, resume=True,
                      data=data())
    assert more.summary["checkpoints"] == ["ckpt-00000050"] and more.summary["checkpoint_deltas"] == 1
    m = manifest(copy, 50)
    assert [p.get("base") for p in m["parts"]] == [40, 40] and m["depth"] == 2  # (restored in place: counted on)


def test_a_resume_onto_three_ps_tasks_and_an_export_of_a_delta_predict_the_same(trained, inproc_client, tmp_path):
    import shutil

    run_dir, result = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    three = dtrain.run(spec(ps=3), client=inproc_client, run_dir=copy, resume=True, data=data())
    assert three.summary["start_step"] == 40 and three.summary["ps_tasks"] == [f"/job:ps/task:{i}" for i in range(3)]
    assert torch.equal(predict(three.model), predict(result.model))
    # On to step 50 on three ps tasks (a full checkpoint: the tables were resharded), then onto one.
    on = dtrain.run(spec(ps=3, steps=50), client=inproc_client, run_dir=copy,
                    resume=True, data=data())
    assert on.summary["checkpoints"] == ["ckpt-00000050"] and on.summary["checkpoint_deltas"] == 0
    one = dtrain.run(spec(ps=1, steps=50), client=inproc_client, run_dir=copy,
                     resume=True, data=data())
    assert one.summary["start_step"] == 50 and torch.equal(predict(one.model), predict(on.model))
    out = tmp_path / "served"
    assert export(run_dir, out)["checkpoint"] == "ckpt-00000040"
    x, _ = records(400, 1)
    torch.testing.assert_close(ExportedModel(out).predict(torch.from_numpy(x)), predict(result.model),
                               rtol=0, atol=1e-6)
