"""Pipeline stages from device pins, as the spec states them (pure: no model is built).

A layer's ``device:`` (``model.layers``) or a child's ``placement.layer_devices`` entry
(``model.module``) names a task of the worker job relative to its replica: ``/job:worker/task:1``
is the replica's second stage task (docs/pipeline.md). Consecutive layers on one task form a
task-level stage, run in that task's process; the tasks a model's pins name are its *stage
tasks* ``0..T-1``, and ``cluster.jobs.worker: W`` then holds ``W / T`` pipeline replicas:
replica ``r``'s stage on position ``p`` runs on worker task ``r * T + p``.

Here: the number of stage tasks, and what the spec alone can tell is wrong with the pins (a pin
outside the worker job, positions without a stage, a task holding two stages of one replica,
what pipelines cannot combine with). ``model.module``'s children are known only once it is
built: the compiler checks those (``dtrain.plan.stages``). Each rule reads a ``PipelineView``
(``view``), the sections it needs, so the pipeline that runs the rules imports this module and
not the other way round.
"""

from __future__ import annotations

from .device import DeviceSpec
from .view import PipelineView

Loc = tuple[str | int, ...]


def pinned_task(value: str | None, worker_job: str) -> int | None:
    """The stage position a device string pins to (its task in the worker job), None if it names no task."""
    if not value:
        return None
    dev = DeviceSpec.from_string(value)
    if dev.job not in (None, worker_job) or dev.task is None:
        return None
    return dev.task


def _pins(spec: PipelineView) -> list[tuple[Loc, str | None]]:
    model = spec.model
    if model is None:
        return []
    if model.layers is not None:
        return [(("model", "layers", i, "device"), layer.device) for i, layer in enumerate(model.layers)]
    return [(("placement", "layer_devices", k), v) for k, v in spec.placement.layer_devices.items()]


def stage_tasks(spec: PipelineView) -> int:
    """T: one more than the highest worker task a layer pin names (1 without task pins)."""
    tasks = [pinned_task(v, spec.placement.worker_job) for _, v in _pins(spec)]
    return 1 + max((t for t in tasks if t is not None), default=0)


def layer_tasks(spec: PipelineView) -> list[int]:
    """``model.layers``: each layer's stage position (an unpinned layer is on its replica's task 0)."""
    return [pinned_task(layer.device, spec.placement.worker_job) or 0 for layer in spec.required_model().layers or ()]


def contiguity_problem(tasks: list[int], names: list[str]) -> tuple[int, str] | None:
    """Stage tasks run in order, each one consecutive run of layers (the first layers on task 0,
    the next on task 1, ...): the first member that breaks that, with the message."""
    for i in range(1, len(tasks)):
        t, before = tasks[i], tasks[i - 1]
        if t < before and t in tasks[:i - 1] + [before]:
            return i, (f"{names[i]} is on stage task {t} again after stage task {before}: a task holds one "
                       "consecutive stage per replica; pin it to a task of its own, or move the layers in between")
        if t < before:
            return i, (f"{names[i]} is on stage task {t} after layers on stage task {before}: stages run in task "
                       f"order (the first layers on /job:worker/task:0, the next on task 1, ...); renumber the pins")
    return None


def missing_positions(tasks: list[int], count: int) -> list[int]:
    return [p for p in range(count) if p not in tasks]


def stage_problems(spec: PipelineView) -> list[tuple[Loc, str]]:
    """What is wrong with the stage pins and what a pipeline of several stage tasks is combined with."""
    problems: list[tuple[Loc, str]] = []
    worker_job, ps_job = spec.placement.worker_job, spec.placement.ps_job
    for loc, value in _pins(spec):
        if value and DeviceSpec.from_string(value).job not in (None, worker_job):
            problems.append((loc, f"{value!r}: layers run in the tasks of the worker job {worker_job!r} (variables "
                                  f"live on {ps_job!r} by themselves); write /job:{worker_job}/task:N to make the "
                                  "layer a pipeline stage on the replica's N-th task"))
    t = spec.training
    if t.microbatches > spec.data.batch_size:
        problems.append((("training", "microbatches"), f"{t.microbatches} micro-batches of a batch of "
                         f"{spec.data.batch_size}: at most data.batch_size; lower it or raise the batch"))
    count = stage_tasks(spec)
    if problems or not any(v for _, v in _pins(spec)):
        return problems
    model = spec.required_model()  # (pins come from the model)
    where: Loc = ("model", "layers") if model.layers is not None else ("placement", "layer_devices")
    if count > 1 and model.layers is not None:
        tasks = layer_tasks(spec)
        names = [f"layer {i} ({layer.name or layer.type})" for i, layer in enumerate(model.layers)]
        bad = contiguity_problem(tasks, names)
        if bad is not None:
            problems.append((("model", "layers", bad[0], "device"), bad[1]))
        for p in missing_positions(tasks, count):
            problems.append((where, f"no layer is pinned to /job:{worker_job}/task:{p}, so stage task {p} would be "
                             f"empty (the stage tasks are 0..{count - 1}: the highest pinned task plus one); pin "
                             "layers there or renumber the pins"))
    workers = spec.cluster.num_tasks(worker_job)
    if count > 1 and workers % count:
        problems.append((("cluster", "jobs", worker_job), f"{workers} worker task(s) for a pipeline of {count} stage "
                         f"tasks: each pipeline replica needs {count} tasks, so the worker task count must be a "
                         f"multiple of {count} (e.g. {count * max(1, workers // count)})"))
    # Any device pin makes stages (on tasks or on devices of one task): what they do not combine with.
    incompatible = [
        (("training", "replication"), t.replication == "in_graph", "in_graph replication runs whole replicas as "
         "graph tasks; layers pinned to devices (pipeline stages) need replication: between_graph"),
        (("training", "overlap"), t.overlap, "overlap is not supported with pipeline stages (each stage already "
         "overlaps its neighbours across micro-batches); remove it"),
        (("training", "total_num_replicas"), t.total_num_replicas is not None and count > 1, "total_num_replicas "
         "(backup replicas) is not supported with pipeline stages; the replicas are the worker tasks / stage tasks"),
        (("training", "pin_cpus"), t.pin_cpus, "pin_cpus is not supported with layers pinned to devices (pipeline "
         "stages); remove it"),
        (where, spec.has_sparse_tables(), "sparse embedding tables are not supported with pipeline stages; "
         "set sparse: false on the table layer or remove the stage pins"),
    ]
    problems.extend((loc, msg) for loc, bad, msg in incompatible if bad)
    return problems
