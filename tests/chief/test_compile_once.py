"""`dtrain plan` and `dtrain run` compile the plan once: the pre-flight's plan is the one printed,
waited for and run, put on the cluster's workers without compiling it again.

The count is honest: the real ``dtrain.plan.compiler.compile`` is wrapped, under every name a
dtrain module holds it by (module-level imports and function-level ones alike), and the commands
run for real (``dtrain run --scheduler``: on the tests' in-process Dask cluster)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dtrain import cli
from dtrain.plan import compiler
from tests.helpers.paths import PIPELINES
from tests.helpers.pipelines import pipeline_yaml


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The name of the pipeline of each call of ``compile``, wherever a dtrain module calls it from."""
    calls: list[str] = []
    real = compiler.compile

    def counted(spec, *args, **kwargs):
        calls.append(spec.name)
        return real(spec, *args, **kwargs)

    counted.__wrapped__ = real  # type: ignore[attr-defined]
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "dtrain"]:
        for attr, value in list(vars(module).items()):
            # (a module first imported under an earlier test holds that test's wrapper: replaced too)
            if value is real or getattr(value, "__wrapped__", None) is real:
                monkeypatch.setattr(module, attr, counted)
    monkeypatch.setattr(cli, "_setup_logging", lambda quiet=False: None)  # (leave the tests' logging alone)
    return calls


def scheduler_address(client) -> str:
    address = client.scheduler.address
    assert address.startswith("tcp://")
    return address


@pytest.mark.parametrize("name", ["digits_async", "stream_parquet", "digits_model_parallel", "hello_graph"])
def test_dtrain_plan_compiles_once(name, compiles, capsys):
    assert cli.main(["plan", str(PIPELINES / f"{name}.yaml"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert compiles == [doc["name"]]


def test_dtrain_plan_on_a_scheduler_compiles_once(inproc_client, compiles, capsys):
    path = PIPELINES / "digits_async.yaml"
    assert cli.main(["plan", str(path), "--json", "--scheduler", scheduler_address(inproc_client)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert compiles == ["digits-async"]
    assert doc["replicas"][0]["address"] is not None  # on the scheduler's workers all the same


def test_dtrain_run_compiles_once(inproc_client, compiles, tmp_path):
    """The pre-flight compiles; connecting waits for the tasks of that plan, the session puts it
    on the workers: nothing compiles again."""
    path = tmp_path / "tiny.yaml"
    path.write_text(pipeline_yaml("compile-once", steps=20))
    run_dir = tmp_path / "run"
    code = cli.main(["run", str(path), "--scheduler", scheduler_address(inproc_client), "--run-dir", str(run_dir),
                     "--quiet"])
    assert code == 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert compiles == ["compile-once"]


def test_dtrain_run_of_a_sharded_dataset_compiles_once(inproc_client, compiles, tmp_path):
    """Its shards are assigned by the pre-flight's compile; the session adds their statistics."""
    run_dir = tmp_path / "run"
    code = cli.main(["run", str(PIPELINES / "stream_parquet.yaml"), "--scheduler", scheduler_address(inproc_client),
                     "--run-dir", str(run_dir), "--quiet", "--set", "training.steps=20", "--set", "checkpoint=null",
                     "--set", "data.epochs=null"])
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] >= 20
    assert compiles == ["stream-parquet"]


def test_a_graph_run_compiles_once(inproc_client, compiles, tmp_path):
    run_dir = tmp_path / "run"
    code = cli.main(["run", str(PIPELINES / "hello_graph.yaml"), "--scheduler", scheduler_address(inproc_client),
                     "--run-dir", str(run_dir), "--quiet"])
    assert code == 0
    assert compiles == ["hello-graph"]
    assert Path(run_dir / "summary.json").exists()
