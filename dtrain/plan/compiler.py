"""Spec -> Plan. Pure: no Dask calls, no files written, nothing allocated (models are built on
torch's meta device to read their parameter layout).

The Plan says where every variable lives (a shard on a task, at an offset in that shard's flat
buffer), which task runs each replica and on what device, where each layer and graph op runs,
and how many bytes each ps task holds. ``dtrain plan`` prints it; the session runs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dtrain.data.shards import Manifest
from dtrain.spec.base import MAX_STEPS
from dtrain.spec.device import DeviceSpec, is_clear, merge_device
from dtrain.spec.elastic import adaptive_bounds, elastic_of
from dtrain.spec.errors import Problem, SpecError
from dtrain.spec.graph import graph_jobs, initial_value
from dtrain.spec.pipeline import PipelineSpec
from dtrain.spec.sections import worker_device_spec

from .assign import assign_workers, resolve_workers  # noqa: F401 (resolve_workers: re-exported)
from .inputs import DataPlan, data_json, format_data, plan_data
from .partitioners import check_partitioner, partition, partition_of
from .placement import VariableRequest, names_variable, place_variables
from .stages import StagePlan, format_stages, plan_stages
from .tables import TablePlan, format_tables, plan_tables

FLOAT32_BYTES = 4
_PART_KEYS = ("axis", "blocks", "stride", "slice_spec")


@dataclass(frozen=True)
class VariablePlan:
    """One variable (or one part of a partitioned variable) on one shard."""

    name: str  # torch's named_parameters() name; parts are "<name>/part_<i>"
    shape: tuple[int, ...]
    bytes: int
    device: str  # canonical DeviceSpec string of the task holding it
    shard: int  # index into Plan.shards
    offset: int  # first element in the shard's flat buffer
    numel: int
    source: str  # the parameter it belongs to
    start: int  # first element within the (flattened) parameter
    axis: int = 0  # a part: the axis it was split along
    blocks: int = 1  # runs of the flattened parameter it holds (> 1: split along an inner axis)...
    stride: int = 0  # ...this many elements apart
    slice_spec: str = ""  # a part: TensorFlow's save-slice spec ("20 43 0,20:15,14"); "" for a whole variable


@dataclass(frozen=True)
class ShardPlan:
    """The variables one task holds, as one flat float32 buffer, served by one ps actor."""

    index: int
    task: str  # "/job:ps/task:0"
    worker: str  # the Dask worker name serving the task ("ps-0") or its listed address
    address: str | None  # resolved worker address (None until put on a cluster's workers: on_workers)
    numel: int
    bytes: int
    holds_global_step: bool
    table_bytes: int = 0  # rows of sparse tables this task holds and their row optimizer state (not in the flat buffer)
    stage: int = 0  # the pipeline stage position whose variables it holds (plan/stages.py)


@dataclass(frozen=True)
class ReplicaPlan:
    """One training replica, pinned to one worker task."""

    index: int
    task: str  # "/job:worker/task:0"
    worker: str
    address: str | None
    device: str  # e.g. "/job:worker/task:0/device:CPU:0"
    stage_tasks: tuple[str, ...] = ()  # a pipeline: the task of each stage position (the first is ``task``)


@dataclass(frozen=True)
class LayerPlan:
    index: int
    type: str
    name: str
    device: str
    output_shape: tuple[int, ...]


@dataclass(frozen=True)
class OpPlan:
    """A graph-section node (variable or op) and where it is evaluated."""

    name: str
    op: str  # "variable" for variables
    inputs: tuple[str | float, ...]
    device: str
    worker: str
    address: str | None
    value: Any = None


@dataclass(frozen=True)
class Plan:
    """Everything the session needs, as plain data (printable, diffable, JSON-able)."""

    name: str
    mode: str
    replication: str
    steps: int | None  # None for a graph pipeline (no training steps)
    replicas_to_aggregate: int
    variables: tuple[VariablePlan, ...] = ()
    shards: tuple[ShardPlan, ...] = ()
    replicas: tuple[ReplicaPlan, ...] = ()
    layers: tuple[LayerPlan, ...] = ()
    ops: tuple[OpPlan, ...] = ()
    tables: tuple[TablePlan, ...] = ()
    fetch: tuple[str, ...] = ()
    ps_bytes: Mapping[str, int] = field(default_factory=dict)
    missing_tasks: tuple[str, ...] = ()
    pipeline_hash: str = ""
    data: DataPlan | None = None  # a sharded dataset's assignment (plan/inputs.py)
    epochs: int | None = None  # data.epochs: training ends when every replica has read its data so often
    stages: tuple[StagePlan, ...] = ()  # pipeline stages (model parallelism; none: one stage)
    stage_positions: int = 1  # stage tasks per replica
    microbatches: int = 1
    assignment: str = ""  # how tasks found their workers: named or auto (plan/assign.py); "" before a cluster
    shared_tasks: tuple[str, ...] = ()  # auto assignment: ps tasks sharing a replica's worker
    replicas_min: int | None = None  # elastic replicas: the fewest live (the replicas are its max slots)
    aggregate_fraction: float | None = None  # elastic sync: the quorum's share of the live replicas
    sync_tokens: bool = False  # training.sync_tokens: TensorFlow's token queue (ps/tokens.py)
    adaptive: tuple[int, int] | None = None  # cluster.adaptive: the embedded cluster's replica workers (min, max)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def required_data(self) -> DataPlan:
        """``data``, which the plan of a sharded dataset has (asking another plan is a bug)."""
        assert self.data is not None, "the plan has no sharded dataset"
        return self.data

    @property
    def used_tasks(self) -> set[str]:
        """The tasks the plan runs something on: its ps shards', its replicas' (each stage task of
        a pipeline replica) and its graph nodes'."""
        return {s.task for s in self.shards} | {t for r in self.replicas for t in (r.stage_tasks or (r.task,))} \
            | {_task_key(DeviceSpec.from_string(o.device)) for o in self.ops}

    @property
    def lockstep(self) -> bool:
        """Sync with every one of a fixed set of replicas in each step (no backups, not elastic):
        replica r's k-th batch is in step k."""
        return self.mode == "sync" and self.replicas_to_aggregate == self.num_replicas and self.replicas_min is None \
            and not self.sync_tokens  # tokens: a replica's gradient may be dropped or count twice in a step

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ps_bytes"] = dict(self.ps_bytes)
        d["num_replicas"] = self.num_replicas
        # a whole variable: no part keys (axis, blocks, stride, slice_spec), as before partitioners
        d["variables"] = [v if v["slice_spec"] else {k: x for k, x in v.items() if k not in _PART_KEYS}
                          for v in d["variables"]]
        d["data"] = data_json(self.data) if self.data is not None else None
        out: dict[str, Any] = json.loads(json.dumps(d))
        return out

    def format(self) -> str:
        """log_device_placement-style text."""
        if self.ops and not self.variables and not self.replicas:
            lines = [f"plan {self.name}: graph, {len(self.ops)} node(s)"
                     + (f", fetch {', '.join(self.fetch)}" if self.fetch else "")]
        else:
            lines = [f"plan {self.name}: {self.mode} {self.replication}, {self.num_replicas} replica(s)"
                     + (f" (elastic: {self.replicas_min} to {self.num_replicas} live)" if self.replicas_min else "")
                     + (" (embedded cluster: Dask adapts its replica workers, {} to {})".format(*self.adaptive)
                        if self.adaptive else "")
                     + (f", aggregate {self.replicas_to_aggregate}" if self.mode == "sync" and not self.aggregate_fraction
                        else f", aggregate {self.aggregate_fraction:g} of the live replicas" if self.mode == "sync"
                        else "")
                     + (" with TF's token queue" if self.sync_tokens else "")
                     + (f", {self.epochs} epoch(s)" if self.epochs else "")
                     + (f", {self.steps} steps" if self.steps is not None and self.steps < MAX_STEPS else "")]
        if self.variables:
            lines.append("variables:")
            w = max(len(v.name) for v in self.variables)
            for v in self.variables:
                shape = "x".join(map(str, v.shape)) or "scalar"
                lines.append(f"  {v.name:<{w}}  {shape:>12}  {v.bytes:>10} B  -> {v.device}"
                             f"  [shard {v.shard} @ {v.offset}]"
                             + (f"  axis {v.axis} slice {v.slice_spec!r}" if v.slice_spec else ""))
        lines.extend(format_tables(self.tables))
        if self.shards:
            lines.append("ps tasks:")
            for s in self.shards:
                where = s.address or s.worker
                lines.append(f"  {s.task:<18} {s.bytes:>10} B  {s.numel:>9} params  on {where}"
                             + (f"  stage task {s.stage}" if self.stages else "")
                             + (f"  + {s.table_bytes} B of table rows and their state" if s.table_bytes else "")
                             + ("  (global_step)" if s.holds_global_step else ""))
        lines.extend(format_data(self.data))
        if self.replicas:
            lines.append("replicas:")
            for r in self.replicas:
                lines.append(f"  replica {r.index}  -> {r.device}  on {r.address or r.worker}"
                             + (f"  stages on {', '.join(r.stage_tasks)}" if r.stage_tasks else ""))
        lines.extend(format_stages(self.stages, self.stage_positions, self.num_replicas, self.microbatches))
        if self.layers:
            lines.append("layers:")
            for layer in self.layers:
                shape = "x".join(map(str, layer.output_shape))
                lines.append(f"  {layer.index:>2} {layer.name:<14} -> {shape:<12} {layer.device}")
        if self.ops:
            lines.append("graph:")
            for op in self.ops:
                ins = ", ".join(map(str, op.inputs))
                if op.op == "variable" and isinstance(op.value, dict):  # an initializer: what it draws
                    init = op.value["initializer"]
                    ins = f"{init['type']} {'x'.join(map(str, op.value['shape'])) or 'scalar'}, seed {init['seed']}"
                lines.append(f"  {op.name} = {op.op}({ins})  -> {op.device}  on {op.address or op.worker}")
        if self.assignment == "auto":
            lines.append("workers assigned automatically (cluster.assign: auto; none named or tagged for the tasks)"
                         + (f"; sharing a replica's worker: {', '.join(self.shared_tasks)}" if self.shared_tasks else ""))
        if self.missing_tasks:
            lines.append("missing tasks: " + ", ".join(self.missing_tasks))
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- compile


def compile(spec: PipelineSpec, workers: Iterable[Any] | Mapping[str, Any] | None = None,  # noqa: A001
            data: tuple[Manifest, Manifest | None] | None = None, keep: Mapping[str, str] | None = None) -> Plan:
    """Turn a validated spec into a Plan. Pure: the same inputs always give the same Plan.
    ``data``: a sharded dataset's (training, evaluation) manifests (``dtrain.data.shards``, read by
    the caller): the plan assigns the training shards to the replicas (:func:`with_data`).
    ``workers`` and ``keep``: the cluster's workers, and an earlier automatic assignment of tasks
    to them kept where its workers live (:func:`on_workers`). A run compiles once and binds that
    plan to the workers there are (again whenever they change); ``compile(spec, workers)`` is the
    two in one."""
    plan = _compile_graph(spec) if spec.is_graph else _compile_training(spec)
    bounds = elastic_of(spec)  # (validation allows it on the replicas' job of a training pipeline only)
    plan = replace(plan, replicas_min=bounds.min if bounds is not None else None, adaptive=adaptive_bounds(spec),
                   aggregate_fraction=spec.aggregate_fraction() if bounds is not None and plan.mode == "sync" else None)
    if data is not None:
        plan = with_data(plan, data)
    return on_workers(plan, spec, workers, keep)


def with_data(plan: Plan, data: tuple[Manifest, Manifest | None]) -> Plan:
    """``plan`` with a sharded dataset's assignment: the training shards of ``data`` (its training
    and evaluation manifests) over the replicas (plan/inputs.py). Pure, cheap: nothing is built."""
    return replace(plan, data=plan_data(data[0], [r.task for r in plan.replicas], data[1]))


def on_workers(plan: Plan, spec: PipelineSpec, workers: Iterable[Any] | Mapping[str, Any] | None,
               keep: Mapping[str, str] | None = None) -> Plan:
    """``plan`` (compiled from ``spec``) on the cluster's ``workers``: the address of the worker
    serving each task (plan/assign.py; ``keep``: an earlier automatic assignment, kept where its
    workers live), the tasks the plan uses that have none, and how they were assigned. Pure and
    cheap: nothing is built, so a run binds its one compiled plan again whenever its workers change
    (a recovery, an elastic join or leave). ``workers`` None: no addresses (``dtrain plan``)."""
    assignment = assign_workers(spec, workers, keep)
    addresses, used = assignment.addresses, plan.used_tasks
    return replace(
        plan,
        shards=tuple(replace(s, address=addresses.get(s.task)) for s in plan.shards),
        replicas=tuple(replace(r, address=addresses.get(r.task)) for r in plan.replicas),
        ops=tuple(replace(o, address=addresses.get(_task_key(DeviceSpec.from_string(o.device)))) for o in plan.ops),
        missing_tasks=tuple(k for k in assignment.missing if k in used),
        assignment=assignment.mode, shared_tasks=assignment.shared)


def _task_key(dev: DeviceSpec) -> str:
    return f"/job:{dev.job}/task:{dev.task if dev.task is not None else 0}"


def _worker_of(spec: PipelineSpec, job: str | None, task: int | None) -> str:
    assert job is not None and task is not None, (job, task)  # a placed device names its job and task
    return spec.cluster.task_workers(job)[task]


def parameter_layout(spec: PipelineSpec) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, numel) of every dense parameter (sparse tables excluded), in creation order,
    without allocating."""
    return _layout_and_tables(spec)[0]


def _layout_and_tables(spec: PipelineSpec) -> tuple[list[tuple[str, tuple[int, ...], int]], list[tuple[str, Any]]]:
    from dtrain.model.build import build_model_skeleton
    from dtrain.model.layers import param_layout
    from dtrain.model.tables import tables_of

    skeleton = build_model_skeleton(spec)
    tables = tables_of(skeleton)
    names = {name for name, _ in tables}
    return [entry for entry in param_layout(skeleton) if entry[0] not in names], tables


def _compile_training(spec: PipelineSpec) -> Plan:
    ps_job, worker_job = spec.placement.ps_job, spec.placement.worker_job
    num_ps = spec.cluster.num_tasks(ps_job)
    requests: list[VariableRequest] = []
    pins = spec.placement.variable_devices
    layout, table_modules = _layout_and_tables(spec)
    staging, layer_shapes = _staging(spec)
    _check_pins(pins, [name for name, _, _ in layout], [name for name, _ in table_modules])
    partitioner = spec.placement.partitioner
    check_partitioner(partitioner, layout, {name for name, _, _ in layout if _pin_for(name, pins) is not None})
    try:
        tables = plan_tables(table_modules, ps_job, num_ps, spec.placement.embedding_partition, spec.optimizer.name)
    except ValueError as exc:  # a table's own storage or optimizer (set on its Table module)
        raise SpecError([Problem(str(exc), path="model.module" if spec.model and spec.model.module else "model.layers")]) from None
    for name, shape, numel in layout:
        pin = _pin_for(name, pins)
        nbytes = numel * FLOAT32_BYTES
        if spec.placement.variables == "partitioned" and pin is None and shape and num_ps > 1 \
                and nbytes >= spec.placement.min_slice_bytes:
            requests.extend(partition(name, shape, FLOAT32_BYTES, num_ps))
        elif pin is None and (parts := partition_of(partitioner, name, shape, FLOAT32_BYTES)):
            requests.extend(parts)
        else:
            requests.append(VariableRequest(name, shape, nbytes, pin, source=name, start=0))
    devices = place_variables(requests, ps_job, num_ps, spec.placement.variables)

    # Shards: every ps task (task 0 always exists: it holds the global step), then any other task
    # that a pinned variable landed on, in first-use order. A pipeline: one shard per task and
    # stage position that holds variables (position 0's ps tasks always), position by position.
    def position(req: VariableRequest) -> int:
        return staging.param_position[req.source or req.name] if staging is not None else 0

    shard_keys = [(f"/job:{ps_job}/task:{i}", 0) for i in range(num_ps)]
    for pos in range(staging.positions if staging is not None else 1):
        for req, dev in zip(requests, devices, strict=True):
            if position(req) == pos and (_task_key(dev), pos) not in shard_keys:
                shard_keys.append((_task_key(dev), pos))
    fill = dict.fromkeys(shard_keys, 0)
    variables = []
    for req, dev in zip(requests, devices, strict=True):
        key = (_task_key(dev), position(req))
        dev = dev if dev.task is not None else dev.replace(task=0)
        numel = req.nbytes // FLOAT32_BYTES
        variables.append(VariablePlan(req.name, tuple(req.shape), req.nbytes, dev.to_string(),
                                      shard_keys.index(key), fill[key], numel, req.source or req.name, req.start,
                                      req.axis, req.blocks, req.stride, req.slice_spec))
        fill[key] += numel
    shards = []
    for i, (task_key, pos) in enumerate(shard_keys):
        dev = DeviceSpec.from_string(task_key)
        table_bytes = sum(p.bytes for t in tables for p in t.parts if p.shard == i)
        shards.append(ShardPlan(i, task_key, _worker_of(spec, dev.job, dev.task), None,
                                fill[task_key, pos], fill[task_key, pos] * FLOAT32_BYTES, i == 0, table_bytes, pos))
    ps_bytes: dict[str, int] = {}
    for s in shards:
        if s.task.startswith(f"/job:{ps_job}/"):
            ps_bytes[s.task] = ps_bytes.get(s.task, 0) + s.bytes + s.table_bytes

    # Only the device fields of worker_device count: replica r always runs on worker task r.
    wd = worker_device_spec(spec.placement.worker_device)
    compute = DeviceSpec(device_type=wd.device_type, device_index=wd.device_index)
    replicas = []
    stride = staging.positions if staging is not None else 1
    for r in range(spec.num_replicas()):
        base = DeviceSpec(job=worker_job, task=r * stride)
        dev = base.make_merged_spec(compute)
        if staging is not None:  # the device of the replica's first stage
            dev = base.make_merged_spec(DeviceSpec.from_string(staging.stages[0].device).replace(job=None, task=None))
        task_key = f"/job:{worker_job}/task:{r * stride}"
        replicas.append(ReplicaPlan(r, task_key, _worker_of(spec, worker_job, r * stride), None,
                                    dev.to_string(), staging.tasks_of(r, worker_job) if staging is not None else ()))

    layers = []
    model = spec.model
    assert model is not None
    if model.layers is not None:
        from dtrain.model.layers import infer_shapes

        shapes = infer_shapes(tuple(model.input_shape or ()), [layer.model_dump() for layer in model.layers])
        replica0 = DeviceSpec(job=worker_job, task=0 if staging is not None else None).make_merged_spec(compute)
        for i, (layer, shape) in enumerate(zip(model.layers, shapes, strict=True)):
            dev = replica0.make_merged_spec(DeviceSpec.from_string(layer.device)) if layer.device else replica0
            layers.append(LayerPlan(i, layer.type, layer.name or f"{layer.type}_{i}", dev.to_string(), tuple(shape)))

    if spec.training.sync_tokens and (tables or len(shards) > 1):  # model.module's tables: known only here
        raise SpecError([Problem("sync_tokens needs every variable in one shard and no sparse tables (the token "
                                 "queue and the update are one step of one ps task): remove sync_tokens",
                                 path="training.sync_tokens")])
    return Plan(
        name=spec.name, mode=spec.training.mode, replication=spec.training.replication, steps=spec.last_step(),
        replicas_to_aggregate=spec.replicas_to_aggregate(), variables=tuple(variables), shards=tuple(shards),
        replicas=tuple(replicas), layers=tuple(layers), tables=tables, ps_bytes=ps_bytes,
        pipeline_hash=spec.pipeline_hash(), epochs=spec.data.epochs, stages=staging.stages if staging is not None else (),
        stage_positions=staging.positions if staging is not None else 1, microbatches=spec.training.microbatches,
        sync_tokens=spec.training.sync_tokens,
    )


def _staging(spec: PipelineSpec) -> tuple[Any, list[tuple[int, ...]] | None]:
    """The model's pipeline stages (None without stage pins) and ``model.layers``' output shapes."""
    from dtrain.model.build import build_model_skeleton
    from dtrain.model.layers import infer_shapes

    model = spec.model
    assert model is not None
    shapes = None
    if model.layers is not None:
        if not any(layer.device for layer in model.layers):
            return None, None
        shapes = [tuple(s) for s in infer_shapes(tuple(model.input_shape or ()), [layer.model_dump() for layer in model.layers])]
        return plan_stages(spec, build_model_skeleton(spec), shapes), shapes
    if not spec.placement.layer_devices:
        return None, None
    return plan_stages(spec, build_model_skeleton(spec), None), None


def _pin_for(name: str, pins: Mapping[str, str]) -> DeviceSpec | None:
    """The pin of a parameter: its exact name, else the longest prefix ending in '.' that matches."""
    keys = [key for key in pins if names_variable(key, name)]  # the exact name is the longest
    return DeviceSpec.from_string(pins[max(keys, key=len)]) if keys else None


def _check_pins(pins: Mapping[str, str], names: list[str], tables: Sequence[str] = ()) -> None:
    """A pin that matches no parameter is a typo: say so instead of silently ignoring it."""
    problems = []
    for key in pins:
        if key in tables:
            problems.append(Problem(f"{key!r} is a sparse embedding table: its rows are partitioned over every ps "
                                    "task (placement.embedding_partition), so it cannot be pinned; remove the pin "
                                    "(or set sparse: false on the layer to make it an ordinary variable)",
                                    path=f"placement.variable_devices.{key}"))
            continue
        if any(names_variable(key, n) for n in names):
            continue
        hint = "" if key.endswith(".") or not any(n.startswith(key + ".") for n in names) \
            else f"; to pin every parameter under it write {key + '.'!r}"
        problems.append(Problem(f"{key!r} names no parameter of the model (parameters: {', '.join(names)}; "
                                f"a prefix must end with '.'){hint}", path=f"placement.variable_devices.{key}"))
    if problems:
        raise SpecError(problems)


def _compile_graph(spec: PipelineSpec) -> Plan:
    # Scopes as in the TF guide's replica_device_setter block (spec/graph.py): the default op device,
    # worker task 0's CPU, is the outer scope of every node; variables first pass the setter, which
    # places nothing without a ps job (ps_tasks=0); `none` clears both (tf.device(None)).
    ps_job, worker_job = graph_jobs(list(spec.cluster.jobs), spec.placement.ps_job, spec.placement.worker_job)
    default = DeviceSpec(job=worker_job, task=0, device_type="CPU", device_index=0)
    scoped = [v for v in spec.variables if not is_clear(v.device)]
    requests = [VariableRequest(v.name, (), FLOAT32_BYTES, DeviceSpec.from_string(v.device) if v.device else None)
                for v in scoped]
    placed = dict(zip([v.name for v in scoped], place_variables(
        requests, ps_job or worker_job, spec.cluster.num_tasks(ps_job) if ps_job else 0, "round_robin"), strict=True))
    ops: list[OpPlan] = []
    for var in spec.variables:
        dev = default.make_merged_spec(placed[var.name]) if var.name in placed else default
        ops.append(OpPlan(var.name, "variable", (), dev.to_string(), _worker_of(spec, dev.job, dev.task), None,
                          initial_value(var, spec.training.seed)))
    for op in spec.graph:
        dev = merge_device(default, op.device) if op.device and not is_clear(op.device) else default
        ops.append(OpPlan(op.name, op.op, tuple(op.inputs), dev.to_string(), _worker_of(spec, dev.job, dev.task),
                          None))
    return Plan(name=spec.name, mode=spec.training.mode, replication=spec.training.replication,
                steps=spec.training.steps, replicas_to_aggregate=1, ops=tuple(ops), fetch=tuple(spec.fetch),
                pipeline_hash=spec.pipeline_hash())
