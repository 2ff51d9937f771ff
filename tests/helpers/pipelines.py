"""One builder for the small pipelines the tests write: a small MLP on sklearn's digits (or a small
DLRM on the records a test passes in), with keyword overrides for each section.

``small_pipeline(...)`` returns the pipeline as a dict; ``pipeline_yaml(...)`` returns the same as
YAML text, one top-level key a line in flow style (``cluster: {jobs: {ps: 2, worker: 2}}``), so a
test may append sections (``pipeline_yaml(...) + "checkpoint: {every_steps: 10}\\n"``) and
``dtrain.loads`` it as before. A section passed as ``None`` is left out. Tests that write odd YAML
on purpose (bad input, line numbers) keep it inline."""

from __future__ import annotations

import json
from typing import Any

import yaml

_DEFAULT: Any = object()  # "the builder's default", where None means "leave the section out"

# The order the sections are written in (others follow in the order given).
_ORDER = ("name", "cluster", "model", "placement", "data", "optimizer", "training", "summary", "eval",
          "checkpoint", "observe", "hooks")


def mlp(hidden: int = 16, *, features: int = 64, classes: int = 10, **extra: Any) -> dict:
    """The small MLP: ``features`` -> linear ``hidden`` -> relu -> linear ``classes``, plus any other
    ``model`` keys (``loss: cross_entropy``)."""
    return {"input_shape": [features],
            "layers": [{"type": "linear", "out": hidden}, {"type": "relu"}, {"type": "linear", "out": classes}],
            **extra}


def dlrm(tables: dict, categorical: list, *, dense: tuple[str, ...] = ("I1", "I2"), bottom: tuple[int, ...] = (8, 4),
         top: tuple[int, ...] = (8, 1), **extra: Any) -> dict:
    """A small DLRM's ``model`` section: ``dense`` features, the ``categorical`` ones and their
    ``tables``, the bottom and top MLPs, the BCE loss."""
    return {"features": {"dense": list(dense), "categorical": categorical}, "tables": tables,
            "dlrm": {"bottom": list(bottom), "top": list(top)}, "loss": "bce_with_logits", **extra}


def small_pipeline(name: str = "tiny", *, jobs: dict | None = None, cluster: dict | None = None,
                   model: Any = _DEFAULT, data: Any = _DEFAULT, optimizer: Any = _DEFAULT,
                   training: dict | None = None, mode: str | None = None, steps: int | None = None,
                   summary: Any = _DEFAULT, checkpoint: dict | None = None, **sections: Any) -> dict:
    """A small pipeline as a dict. Defaults: ``cluster: {jobs: {ps: 2, worker: 2}}`` (``jobs``
    replaces the jobs, ``cluster`` adds keys beside them), ``model: mlp()``, ``data: {source:
    sklearn:digits, batch_size: 16}``, ``optimizer: {name: sgd, lr: 0.1}``, ``summary:
    {every_steps: 10, tensorboard: false}``; no ``training`` unless ``training``, ``mode`` or
    ``steps`` is given (``mode`` and ``steps`` go first in it), no ``checkpoint`` unless given.
    Any other section (``placement``, ``eval``, ``hooks``, ``observe``) by its name."""
    spec: dict[str, Any] = {"name": name,
                            "cluster": {"jobs": dict(jobs) if jobs is not None else {"ps": 2, "worker": 2},
                                        **(cluster or {})},
                            "model": mlp() if model is _DEFAULT else model,
                            "data": {"source": "sklearn:digits", "batch_size": 16} if data is _DEFAULT else data,
                            "optimizer": {"name": "sgd", "lr": 0.1} if optimizer is _DEFAULT else optimizer}
    run = {**({"mode": mode} if mode is not None else {}), **({"steps": steps} if steps is not None else {}),
           **(training or {})}
    spec["training"] = run or None
    spec["summary"] = {"every_steps": 10, "tensorboard": False} if summary is _DEFAULT else summary
    spec["checkpoint"] = checkpoint
    spec.update(sections)
    ordered = {k: spec[k] for k in _ORDER if k in spec} | spec
    return {k: v for k, v in ordered.items() if v is not None}


def small_dlrm(name: str, *, tables: dict, categorical: list, dense: tuple[str, ...] = ("I1", "I2"),
               **kw: Any) -> dict:
    """``small_pipeline`` with a small DLRM (``dlrm(tables, categorical, dense=dense)``) on the
    records the test passes to ``dtrain.run``: ``data: {batch_size: 64, shuffle: false}``,
    ``optimizer: {name: adagrad, lr: 0.1}``, unless given."""
    kw.setdefault("data", {"batch_size": 64, "shuffle": False})
    kw.setdefault("optimizer", {"name": "adagrad", "lr": 0.1})
    return small_pipeline(name, model=dlrm(tables, categorical, dense=dense), **kw)


def pipeline_yaml(name: str = "tiny", **kw: Any) -> str:
    """``small_pipeline(name, **kw)`` as YAML text (``to_yaml``)."""
    return to_yaml(small_pipeline(name, **kw))


def dlrm_yaml(name: str, **kw: Any) -> str:
    """``small_dlrm(name, **kw)`` as YAML text."""
    return to_yaml(small_dlrm(name, **kw))


def to_yaml(spec: dict) -> str:
    """A pipeline dict as YAML text: a line per top-level key, its value in flow style; ``model``
    as a block of its keys (each in flow style)."""
    lines = []
    for key, value in spec.items():
        if key == "model" and isinstance(value, dict):
            lines.append("model:")
            lines += [f"  {k}: {_flow(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if yaml.safe_load(f"[{text}]") == [value] else json.dumps(value)
    text = str(value)
    plain = text and yaml.safe_load(f"{{k: [{text}]}}") == {"k": [text]}
    return text if plain else json.dumps(text)


# ------------------------------------------------------------------ pipelines more than one module runs

OPTIMIZERS = {"sgd": {"name": "sgd", "lr": 0.1}, "momentum": {"name": "momentum", "lr": 0.05, "momentum": 0.9},
              "adam": {"name": "adam", "lr": 0.01}}


def tiny(text: str = "") -> Any:
    """tests/chief/test_session.py's run (async, 60 steps, hidden 32, batch 32) with ``text``
    appended, loaded."""
    import dtrain

    return dtrain.loads(pipeline_yaml("tiny", model=mlp(32), data={"source": "sklearn:digits", "batch_size": 32},
                                      mode="async", steps=60, summary={"every_steps": 20, "tensorboard": False})
                        + text, base_dir=".")


def stage_spec(workers: int, optimizer: str, mode: str = "sync", microbatches: int = 4, steps: int = 50,
               num_ps: int = 1, shared_memory: bool = True) -> Any:
    """An MLP in two pipeline stages (worker tasks 0 and 1), loaded; ``optimizer`` in YAML's flow
    style (``"{name: sgd, lr: 0.1}"``: the tests' parameter ids)."""
    import dtrain

    w0, w1 = "/job:worker/task:0", "/job:worker/task:1"
    model = {"input_shape": [64],
             "layers": [{"type": "linear", "out": 24, "device": w0}, {"type": "tanh"},
                        {"type": "linear", "out": 16, "device": w1}, {"type": "relu", "device": w1},
                        {"type": "linear", "out": 10, "device": w1}],
             "loss": "cross_entropy"}
    return dtrain.loads(pipeline_yaml(
        "stages", jobs={"ps": num_ps, "worker": workers}, model=model, optimizer=yaml.safe_load(optimizer),
        training={"mode": mode, "steps": steps, "seed": 5, "microbatches": microbatches,
                  "shared_memory": shared_memory},
        summary={"every_steps": 25, "tensorboard": False}), base_dir=".")


# tests/chief/test_partitioned.py's run (its parts along axis 1), also run on a GPU by test_cuda_runs.py.
PARTITIONED = pipeline_yaml("partitioned", model=mlp(loss="cross_entropy"),
                            placement={"partitioner": {"type": "fixed_size", "num_shards": 3, "axis": 1}},
                            optimizer={"name": "momentum", "lr": 0.05, "momentum": 0.9},
                            training={"mode": "sync", "steps": 60, "seed": 3},
                            summary={"every_steps": 20, "tensorboard": False}, checkpoint={"every_steps": 30, "keep": 2})
