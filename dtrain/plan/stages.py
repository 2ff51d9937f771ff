"""Pipeline stages of a model (model parallelism), as plain data. Pure: the model is built on
torch's meta device only.

A *stage* is a run of consecutive layers (``model.layers``) or top-level children
(``model.module`` with ``placement.layer_devices``) on one device; its ``position`` is the worker
task it runs on relative to its replica (``dtrain.spec.stages``). Stages of one position run in
that task's process, one after the other (on their own devices: activations move between them);
activations and their gradients cross between positions over a stage link (docs/pipeline.md).
Every variable belongs to the position of its layer, and the ps keeps one shard per ps task and
position, so each stage task pulls and pushes only its own layers' parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtrain.spec.device import DeviceSpec
from dtrain.spec.errors import Problem, SpecError
from dtrain.spec.pipeline import PipelineSpec
from dtrain.spec.sections import worker_device_spec
from dtrain.spec.stages import contiguity_problem, missing_positions, stage_tasks

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers, where it runs (for replica 0; replica r adds r * positions to the task)."""

    index: int
    position: int  # the worker task relative to the replica (0 .. positions - 1)
    device: str  # e.g. /job:worker/task:1/device:CPU:0 (replica 0)
    layers: tuple[str, ...]  # layer names (model.layers: "0", "1", ...; model.module: child names)
    members: tuple[int, ...]  # their indices in the model's top-level sequence
    param_bytes: int
    output_shape: tuple[int, ...]  # of one example
    activation_bytes: int  # of the stage's output per micro-batch (float32)


@dataclass(frozen=True)
class Staging:
    """A model's stages and how its parameters map to positions."""

    stages: tuple[StagePlan, ...]
    positions: int  # stage tasks per replica
    param_position: dict[str, int]  # parameter name -> position

    def tasks_of(self, replica: int, worker_job: str) -> tuple[str, ...]:
        """The worker tasks of replica ``replica``'s stage positions."""
        return tuple(f"/job:{worker_job}/task:{replica * self.positions + p}" for p in range(self.positions))


def _children(skeleton: Any) -> list[tuple[str, Any]]:
    return list(skeleton.named_children())


def _module_pins(spec: PipelineSpec, names: list[str]) -> tuple[list[str | None], list[Problem]]:
    """The device string of each child (exact name, else the longest key that prefixes it)."""
    pins = spec.placement.layer_devices
    out: list[str | None] = []
    used: set[str] = set()
    for name in names:
        key = name if name in pins else max((k for k in pins if name.startswith(k)), key=len, default=None)
        if key is not None:
            used.add(key)
        out.append(pins[key] if key is not None else None)
    problems = [Problem(f"{key!r} names no top-level child of {spec.required_model().module} (children: {', '.join(names)}); "
                        "use a child's name or a prefix of names", path=f"placement.layer_devices.{key}")
                for key in pins if key not in used]
    return out, problems


def _module_shapes(spec: PipelineSpec, skeleton: Any) -> list[tuple[int, ...]]:
    """Run the children in order on the meta device; the module must give the same output shape
    as when called whole (else it is not a sequence of its children)."""
    import torch

    path = "placement.layer_devices"
    model = spec.required_model()
    if not model.input_shape:
        raise SpecError([Problem(f"pipeline stages of {model.module} need model.input_shape (the shape of "
                                 "one example) to size the activations between stages; add it", path="model.input_shape")])
    x = torch.empty((2, *model.input_shape), device="meta")
    shapes = []
    was = skeleton.training
    skeleton.eval()
    try:
        with torch.no_grad():
            h = x
            for name, child in _children(skeleton):
                try:
                    h = child(h)
                except Exception as exc:
                    raise SpecError([Problem(
                        f"{spec.required_model().module} cannot be split into stages: its children do not run one after the "
                        f"other like nn.Sequential (child {name!r} failed on the previous child's output: "
                        f"{type(exc).__name__}: {exc}); make its forward a sequence of its children or remove "
                        "the pins", path=path)]) from None
                if not isinstance(h, torch.Tensor):
                    raise SpecError([Problem(f"{spec.required_model().module} cannot be split into stages: child {name!r} "
                                             f"returns {type(h).__name__}, not one tensor", path=path)])
                shapes.append(tuple(h.shape[1:]))
            whole = skeleton(x)
    finally:
        skeleton.train(was)
    if tuple(whole.shape[1:]) != shapes[-1]:
        raise SpecError([Problem(f"{spec.required_model().module} cannot be split into stages: its children run in order "
                                 f"give shape {list(shapes[-1])} but the module gives {list(whole.shape[1:])}; "
                                 "make its forward a sequence of its children or remove the pins", path=path)])
    return shapes


def plan_stages(spec: PipelineSpec, skeleton: Any, layer_shapes: list[tuple[int, ...]] | None) -> Staging | None:
    """The stages of a model with stage pins (None for a model without any: one stage, no split).
    ``skeleton``: the model on the meta device; ``layer_shapes``: ``model.layers``' output shapes."""
    model = spec.required_model()
    pins_given = any(layer.device for layer in model.layers) if model.layers is not None \
        else bool(spec.placement.layer_devices)
    if not pins_given:
        return None
    worker_job = spec.placement.worker_job
    wd = worker_device_spec(spec.placement.worker_device)
    replica0 = DeviceSpec(job=worker_job, task=0).make_merged_spec(
        DeviceSpec(device_type=wd.device_type, device_index=wd.device_index))
    if model.layers is not None:
        names = [str(i) for i in range(len(model.layers))]
        labels = [layer.name or f"{layer.type}_{i}" for i, layer in enumerate(model.layers)]
        devices = [layer.device for layer in model.layers]
        shapes = list(layer_shapes or ())
    else:
        names = [n for n, _ in _children(skeleton)]
        if not names:
            raise SpecError([Problem(f"{model.module} has no child modules to split into stages; remove "
                                     "placement.layer_devices", path="placement.layer_devices")])
        labels = names
        devices, problems = _module_pins(spec, names)
        if problems:
            raise SpecError(problems)
        shapes = _module_shapes(spec, skeleton)
    resolved = [replica0.make_merged_spec(DeviceSpec.from_string(d)) if d else replica0 for d in devices]
    positions = stage_tasks(spec)
    tasks = [d.task or 0 for d in resolved]
    if model.module is not None:  # the spec could not check these without the module's children
        where = "placement.layer_devices"
        bad = contiguity_problem(tasks, [f"child {n!r}" for n in names])
        problems = [Problem(bad[1], path=where)] if bad else []
        problems += [Problem(f"no child is pinned to /job:{worker_job}/task:{p}, so stage task {p} would be empty "
                             f"(stage tasks 0..{positions - 1}); pin children there or renumber", path=where)
                     for p in missing_positions(tasks, positions)]
        if problems:
            raise SpecError(problems)
    params: dict[str, int] = {}
    param_member: dict[str, int] = {}
    for name, p in skeleton.named_parameters():
        head = name.split(".", 1)[0]
        if head not in names or (model.module is not None and "." not in name):
            raise SpecError([Problem(f"{model.module}'s parameter {name!r} belongs to no child module, so no stage "
                                     "holds it; move it into a child or remove the pins", path="placement.layer_devices")])
        param_member[name] = names.index(head)
        params[name] = p.numel()
    mb = math.ceil(spec.data.batch_size / spec.training.microbatches)
    stages: list[StagePlan] = []
    start = 0
    for i in range(1, len(names) + 1):
        if i < len(names) and resolved[i] == resolved[start]:
            continue
        members = tuple(range(start, i))
        out = tuple(shapes[i - 1]) if shapes else ()
        nbytes = sum(n for name, n in params.items() if param_member[name] in members) * FLOAT32_BYTES
        stages.append(StagePlan(len(stages), tasks[start], resolved[start].to_string(),
                                tuple(labels[m] for m in members), members, nbytes, out,
                                math.prod(out) * mb * FLOAT32_BYTES))
        start = i
    position_of = {m: s.position for s in stages for m in s.members}
    return Staging(tuple(stages), positions, {name: position_of[m] for name, m in param_member.items()})


def format_stages(stages: tuple[StagePlan, ...], positions: int, replicas: int, microbatches: int) -> list[str]:
    if not stages:
        return []
    lines = [f"stages: {len(stages)} on {positions} task(s) per replica, {replicas} pipeline replica(s), "
             f"{microbatches} micro-batch(es) per step"]
    for s in stages:
        lines.append(f"  stage {s.index} -> {s.device}  layers {', '.join(s.layers)}  params {s.param_bytes} B  "
                     f"activations {s.activation_bytes} B per micro-batch")
    return lines
