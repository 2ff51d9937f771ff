"""What one replica, or one pipeline stage of it, needs to train: its job description. Pure: no
Dask (the model section's sparse tables are found on torch's meta device).

The chief compiles the plan once per run; for each replica task it submits (and each in-graph
tower, each pipeline stage task) it derives from the spec and that plan a frozen, picklable
:class:`ReplicaJob`, and the worker side (``dtrain.worker``) reads nothing else of either. A job
holds:

- ``model``: the spec's model section, whole: the replica builds its model from it (the job
  stands in for the spec in ``dtrain.model.build``: ``build_model(job, seed=...)``);
- ``data``: the replica's slice of the data (:class:`DataSlice`): batch size, shuffle and epochs,
  and either the in-memory dataset's loading arguments (:class:`MemoryDataset`; every replica
  loads it whole and takes slice ``index`` of ``replicas``) or its own shards of a sharded
  dataset (:class:`StreamSlice`: their stream layout, schema, statistics); none for a pipeline
  stage after the first (its batches come from upstream);
- ``shards``: the ps shards it talks to (:class:`ShardSlot`: each one's index in the plan, its
  flat buffer's size, its sparse tables' row widths), ``parts``: where its parameters sit in
  their buffers, numbered in ``shards`` order; ``tables``: the sparse tables' plans;
- ``settings``: the training settings its loop reads (:class:`ReplicaSettings`: seed, threads,
  micro-batches, mode, timeouts, overlap, buckets, CPU pinning, soft placement, telemetry);
- ``stage``: for a pipeline stage task, its position, its layers on each device of it and the
  shape of its link to the next stage (:class:`StageSlot`).

What only the running cluster knows comes with the task beside the job: the shards' actor keys
and data-plane endpoints (a new generation of shards has new ones), the submission's attempt,
where the replica resumes in its data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from dtrain.data.shards import Manifest, Shard
from dtrain.data.stream import StreamLayout
from dtrain.spec.layers import EmbeddingLayer, ModelSpec
from dtrain.spec.pipeline import PipelineSpec

from .compiler import Plan
from .layout import Part, ShardLayout, part_of
from .tables import TablePlan


@dataclass(frozen=True)
class ShardSlot:
    """One ps shard a replica (or a stage) pulls from and pushes to."""

    index: int  # in the plan: its actor and data-plane endpoint are the session's, by this index
    numel: int  # its flat buffer's elements
    tables: tuple[tuple[str, int], ...] = ()  # (table, row width) of each sparse table with a part on it


@dataclass(frozen=True)
class ReplicaSettings:
    """The training settings a replica's loop reads (``training``, ``placement.soft``, ``observe``)."""

    seed: int
    torch_threads: int
    microbatches: int
    mode: str  # async | sync
    call_timeout_s: float
    barrier_timeout_s: float
    max_staleness: int | None
    overlap: bool  # push while the next step computes (``TrainingSpec.overlaps``, given the job's tables)
    bucket_mb: float
    pin_cpus: bool
    stage_start_timeout_s: float
    soft_placement: bool  # placement.soft: a GPU device without a GPU computes on the CPU
    interval_s: float  # observe.interval_s: the replica reports its counters every half of it
    telemetry: bool  # observe.telemetry: the task reports the counters to the chief

    @property
    def wait_timeout_s(self) -> float:
        """How long the loop waits for a ps reply: a call's timeout, plus the barrier's where a
        reply may wait for the other replicas (sync, or bounded staleness)."""
        barrier = self.mode == "sync" or self.max_staleness is not None
        return self.call_timeout_s + (self.barrier_timeout_s if barrier else 0)


@dataclass(frozen=True)
class MemoryDataset:
    """An in-memory dataset's loading arguments (``dtrain.data.sources.load_dataset``): every
    process that loads it gets the same split (and caches it by these)."""

    source: str
    base_dir: str
    target: str
    test_fraction: float
    standardize: bool
    seed: int
    task: Literal["classification", "regression"] | None
    num_samples: int
    num_features: int | None
    num_classes: int
    id_rows: int | None
    eval_source: str | None


@dataclass(frozen=True)
class StreamSlice:
    """A replica's own shards of a sharded dataset and how it streams them."""

    layout: StreamLayout  # where each of its batches comes from
    parts: tuple[Shard, ...]  # what it reads (paths, row groups, rows)
    format: str  # the shards' format ("dask": a Dask collection's partitions)
    schema: Manifest | None  # the columns every file shard holds
    stats: Any  # the statistics pass's standardisation and labels (dtrain.data.stats.DataStats)
    partitions: bytes  # a Dask collection's partitions (pickled graphs, by index); b"" for files
    readers: int
    prefetch: int
    skip_bad_files: bool


@dataclass(frozen=True)
class DataSlice:
    """What a replica reads: its slice of an in-memory dataset, or its shards of a sharded one."""

    batch_size: int
    shuffle: bool
    epochs: int | None
    replicas: int  # the in-memory dataset is cut into this many slices (the job's index is its own)
    memory: MemoryDataset | None = None
    stream: StreamSlice | None = None


@dataclass(frozen=True)
class StageSlot:
    """A pipeline stage task's place in its replica."""

    position: int  # 0 .. positions - 1
    positions: int  # stage tasks per replica
    devices: tuple[tuple[str, tuple[int, ...]], ...]  # per stage at this position: its device, its layers' indices
    link: tuple[int, int] | None  # the link to the next stage: (micro-batches, bytes) of its shared memory (link_shape)


@dataclass(frozen=True)
class ReplicaJob:
    """Everything a replica task, in-graph tower or stage task reads (the module docstring)."""

    name: str  # the pipeline's (the replica's telemetry is tagged with the run's id, else this)
    index: int  # the replica
    device: str  # the plan's device of the replica (its first stage's)
    model: ModelSpec
    data: DataSlice | None
    shards: tuple[ShardSlot, ...]
    parts: tuple[Part, ...]
    tables: tuple[TablePlan, ...]
    settings: ReplicaSettings
    stage: StageSlot | None = None

    def shard_layout(self) -> ShardLayout:
        """Its parameters <-> its shards' flat buffers."""
        return ShardLayout(self.parts, [s.numel for s in self.shards])


def replica_job(spec: PipelineSpec, plan: Plan, index: int) -> ReplicaJob:
    """Replica ``index``'s job (a between-graph replica task or an in-graph tower: every shard)."""
    shards = tuple(_slot(plan, s.index) for s in plan.shards)
    return ReplicaJob(spec.name, index, plan.replicas[index].device, _model(spec), _data(spec, plan, index), shards,
                      tuple(part_of(v, v.shard) for v in plan.variables), plan.tables,
                      _settings(spec, tables=bool(plan.tables)))


def stage_job(spec: PipelineSpec, plan: Plan, index: int, position: int) -> ReplicaJob:
    """The job of stage ``position`` of pipeline replica ``index``: its own shards and layers; data
    only for the first stage."""
    ids = stage_shards(plan, position)
    local = {g: i for i, g in enumerate(ids)}
    mine = [s for s in plan.stages if s.position == position]
    link = link_shape(spec, plan, position) if position + 1 < plan.stage_positions else None
    stage = StageSlot(position, plan.stage_positions, tuple((s.device, s.members) for s in mine), link)
    return ReplicaJob(spec.name, index, plan.replicas[index].device, _model(spec),
                      _data(spec, plan, index) if position == 0 else None, tuple(_slot(plan, g) for g in ids),
                      tuple(part_of(v, local[v.shard]) for v in plan.variables if v.shard in local), (),
                      _settings(spec, tables=False), stage)


def stage_shards(plan: Plan, position: int) -> list[int]:
    """The shards holding stage ``position``'s variables, in plan order."""
    return [s.index for s in plan.shards if s.stage == position]


def link_shape(spec: PipelineSpec, plan: Plan, position: int) -> tuple[int, int] | None:
    """(micro-batches, capacity in bytes) of the shared-memory regions of the link from stage
    ``position`` to the next: one micro-batch's activations as the plan sizes them, plus room for
    its labels (64 bytes an example). None when ``training.shared_memory`` is off."""
    if not spec.training.shared_memory:
        return None
    last = [s for s in plan.stages if s.position == position][-1]
    examples = -(-spec.data.batch_size // spec.training.microbatches)
    return spec.training.microbatches, -(-(last.activation_bytes + 64 * examples) // 64) * 64 + 64


def stream_layout(spec: PipelineSpec, plan: Plan, index: int) -> StreamLayout:
    """Replica ``index``'s stream layout (also what the chief locates positions with)."""
    d = spec.data
    rep = plan.required_data().replicas[index]
    return StreamLayout(tuple(p.rows for p in rep.parts), d.batch_size, d.shuffle_buffer, spec.training.seed, index,
                        d.shuffle, d.epochs)


def memory_dataset(spec: PipelineSpec) -> MemoryDataset:
    """The loading arguments of the pipeline's in-memory dataset."""
    d = spec.data
    model = spec.required_model()
    task = d.task
    if task is None and d.source == "synthetic":
        task = "classification" if model.loss in ("cross_entropy", "bce_with_logits") else "regression"
    num_features = None
    if d.source == "synthetic" and model.input_shape:
        num_features = 1
        for n in model.input_shape:
            num_features *= n
    num_classes = d.num_classes if model.loss == "cross_entropy" else 2
    return MemoryDataset(d.source, str(spec.base_dir), d.target, d.test_fraction, d.standardize, spec.training.seed,
                         task, d.num_samples, num_features, num_classes, id_rows_of(spec), d.eval_source)


_TABLE_MODULES: dict[tuple[str, str], bool] = {}


def _module_has_tables(model: Any) -> bool:
    """Whether a ``model.module`` holds sparse embeddings (built once on the meta device)."""
    from types import SimpleNamespace

    from dtrain.model.build import build_model_skeleton
    from dtrain.model.tables import tables_of

    key = (model.module, json.dumps(model.kwargs or {}, sort_keys=True, default=str))
    if key not in _TABLE_MODULES:
        try:
            _TABLE_MODULES[key] = bool(tables_of(build_model_skeleton(SimpleNamespace(model=model))))
        except Exception:  # a module that cannot be built is reported where it is built (preflight)
            return False
    return _TABLE_MODULES[key]


def id_rows_of(spec: PipelineSpec) -> int | None:
    """The model takes integer ids: the rows of its first layer's table, or 0 for a ``model.module``
    with sparse embeddings (what it computes from them is its own: the ps checks them); None when
    its features are numbers."""
    from dtrain.model.tables import TABLE_TYPES

    model = spec.required_model()
    if model.features is not None:
        return 0  # packed records: each table folds (or checks) its ids itself
    first = model.layers[0] if model.layers else None
    if isinstance(first, EmbeddingLayer) and first.type in TABLE_TYPES:
        return first.num_embeddings
    return 0 if model.module is not None and _module_has_tables(model) else None


def _model(spec: PipelineSpec) -> ModelSpec:
    return spec.required_model().model_copy(deep=True)  # (the job's own: a later change to the spec is not its)


def _slot(plan: Plan, shard: int) -> ShardSlot:
    s = plan.shards[shard]
    return ShardSlot(s.index, s.numel, tuple((t.name, t.dim) for t in plan.tables if s.index < len(t.parts)))


def _settings(spec: PipelineSpec, tables: bool) -> ReplicaSettings:
    t = spec.training
    return ReplicaSettings(t.seed, t.torch_threads, t.microbatches, t.mode, t.call_timeout_s, t.barrier_timeout_s,
                           t.max_staleness, t.overlaps(tables=tables), t.bucket_mb, t.pin_cpus,
                           t.stage_start_timeout_s, spec.placement.soft, spec.observe.interval_s,
                           spec.observe.telemetry)


def _data(spec: PipelineSpec, plan: Plan, index: int) -> DataSlice:
    d = spec.data
    if plan.data is None:
        return DataSlice(d.batch_size, d.shuffle, d.epochs, plan.num_replicas, memory=memory_dataset(spec))
    data = plan.data
    stream = StreamSlice(stream_layout(spec, plan, index), data.replicas[index].parts, data.format, data.schema,
                         data.stats, data.partitions, d.readers, d.prefetch, d.skip_bad_files)
    return DataSlice(d.batch_size, d.shuffle, d.epochs, plan.num_replicas, stream=stream)
