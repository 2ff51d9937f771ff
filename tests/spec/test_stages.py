"""Pipeline stage pins as the spec states them: the stage tasks, the replicas they give, and the
bad inputs refused with the key and the fix (exit 2 through the CLI: tests/test_cli.py)."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.spec.errors import SpecError
from dtrain.spec.loading import validate
from dtrain.spec.stages import stage_tasks

W0, W1, W2 = "/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"


def model(*devices: str | None) -> dict[str, Any]:
    layers = [{"type": "linear", "out": 8, **({"device": d} if d else {})} for d in devices]
    return {"input_shape": [4], "layers": layers}


def spec(devices: tuple[str | None, ...], workers: int = 2, **training: Any):
    return validate({"model": model(*devices), "cluster": {"jobs": {"ps": 1, "worker": workers}},
                     "training": training})


def problems(devices: tuple[str | None, ...], workers: int = 2, **training: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec(devices, workers, **training)
    return [(p.path, p.message) for p in info.value.problems]


def test_stage_tasks_and_pipeline_replicas():
    assert stage_tasks(spec((None, None))) == 1 and spec((None, None)).num_replicas() == 2
    s = spec((W0, W1), workers=4, mode="sync")
    assert stage_tasks(s) == 2 and s.num_replicas() == 2 and s.replicas_to_aggregate() == 2
    assert spec((None, W1, W2), workers=3).num_replicas() == 1  # an unpinned layer is on task 0
    assert spec((W0, "/gpu:0"), workers=2).num_replicas() == 2  # a device alone: a stage inside task 0


@pytest.mark.parametrize(("devices", "workers", "training", "path", "words"), [
    ((W1, W0), 2, {}, "model.layers[1].device", "stages run in task order"),
    ((W0, W1, W0), 2, {}, "model.layers[2].device", "on stage task 0 again after stage task 1"),
    ((W0, W2), 3, {}, "model.layers", "stage task 1 would be empty"),
    ((W0, W1), 3, {}, "cluster.jobs.worker", "must be a multiple of 2"),
    ((W0, "/job:worker/task:5"), 2, {}, "model.layers[1].device", "names task 5 but job 'worker' has 2 task(s)"),
    ((W0, "/job:ps/task:0"), 2, {}, "model.layers[1].device", "layers run in the tasks of the worker job"),
    ((W0, W1), 2, {"replication": "in_graph", "mode": "sync"}, "training.replication", "between_graph"),
    ((W0, W1), 2, {"overlap": True}, "training.overlap", "not supported with pipeline stages"),
    ((W0, W1), 2, {"total_num_replicas": 1}, "training.total_num_replicas", "not supported"),
    ((None,), 2, {"microbatches": 64}, "training.microbatches", "at most data.batch_size"),
])
def test_bad_stage_pins_name_the_key_and_the_fix(devices, workers, training, path, words):
    found = problems(devices, workers, **training)
    assert any(p == path and words in m for p, m in found), found


def test_layer_devices_are_for_modules_and_checked_against_the_cluster():
    with pytest.raises(SpecError) as info:
        validate({"model": model(None), "placement": {"layer_devices": {"0": W1}}})
    assert info.value.problems[0].path == "placement.layer_devices"
    with pytest.raises(SpecError) as info:
        validate({"model": {"module": "tests.helpers.models:TinyMLP", "input_shape": [64]},
                  "placement": {"layer_devices": {"net": "/job:worker/task:7"}}})
    assert info.value.problems[0].path == "placement.layer_devices.net"
    assert "names task 7" in info.value.problems[0].message
