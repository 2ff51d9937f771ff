"""A replica's job description (dtrain.plan.job): what it holds for a few pipelines, that it is
frozen, picklable, the same on any workers, and carries neither the spec nor the plan."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pydantic
import pytest

import dtrain
from dtrain.chief.inputs import file_input
from dtrain.plan.compiler import Plan
from dtrain.plan.job import (
    ReplicaJob,
    link_shape,
    memory_dataset,
    replica_job,
    stage_job,
    stage_shards,
    stream_layout,
)
from dtrain.plan.layout import ShardLayout
from dtrain.spec.pipeline import PipelineSpec
from tests.helpers.paths import PIPELINES


def load(name: str, *overrides: str) -> PipelineSpec:
    return dtrain.load(PIPELINES / f"{name}.yaml", overrides=list(overrides))


def objects(value: Any) -> list[Any]:
    """Every object reachable from ``value`` through dataclass fields, pydantic fields, tuples,
    lists and dicts (``value`` included)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        out.append(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        elif isinstance(v, pydantic.BaseModel):
            stack.extend(getattr(v, name) for name in type(v).model_fields)
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend([*v.keys(), *v.values()])
    return out


def check_self_contained(job: ReplicaJob) -> None:
    """Frozen, picklable (the same job back), and holding neither the spec nor the plan."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.index = 5  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(job)) == job
    assert not [type(o).__name__ for o in objects(job) if isinstance(o, (PipelineSpec, Plan))]
    blob = pickle.dumps(job)
    assert b"dtrain.spec.pipeline" not in blob and b"dtrain.plan.compiler" not in blob


def test_an_in_memory_replica_gets_its_slice_every_shard_and_its_settings():
    spec = load("digits_async")
    plan = dtrain.compile(spec)
    job = replica_job(spec, plan, 1)
    check_self_contained(job)
    assert (job.name, job.index, job.device) == ("digits-async", 1, plan.replicas[1].device)
    assert job.model == spec.model and job.model is not spec.model  # the section, a copy of its own
    assert job.stage is None and job.tables == ()
    assert [(s.index, s.numel, s.tables) for s in job.shards] == [(s.index, s.numel, ()) for s in plan.shards]
    layout = job.shard_layout()
    assert (layout.parts, layout.shard_numel) == (ShardLayout.from_plan(plan).parts,
                                                  ShardLayout.from_plan(plan).shard_numel)
    data = job.data
    assert data is not None and data.stream is None
    assert (data.batch_size, data.shuffle, data.epochs, data.replicas) == (
        spec.data.batch_size, spec.data.shuffle, spec.data.epochs, plan.num_replicas)
    assert data.memory == memory_dataset(spec)
    assert (data.memory.source, data.memory.seed, data.memory.id_rows) == ("sklearn:digits", spec.training.seed, None)
    t = spec.training
    s = job.settings
    assert (s.seed, s.torch_threads, s.microbatches, s.mode, s.call_timeout_s, s.barrier_timeout_s, s.bucket_mb,
            s.pin_cpus, s.soft_placement, s.interval_s, s.telemetry) == (
        t.seed, t.torch_threads, t.microbatches, t.mode, t.call_timeout_s, t.barrier_timeout_s, t.bucket_mb,
        t.pin_cpus, spec.placement.soft, spec.observe.interval_s, spec.observe.telemetry)
    assert s.overlap == t.overlaps() is True  # async between_graph, no tables
    assert s.wait_timeout_s == t.call_timeout_s  # async without bounded staleness: no barrier


def test_sync_and_bounded_staleness_wait_out_the_barrier():
    for name in ("digits_sync", "digits_staleness"):
        spec = load(name)
        s = replica_job(spec, dtrain.compile(spec), 0).settings
        assert s.wait_timeout_s == spec.training.call_timeout_s + spec.training.barrier_timeout_s, name
        assert s.overlap is False, name


def test_a_replica_of_sparse_tables_gets_their_plans_and_each_shards_widths():
    spec = load("ctr_sparse")
    plan = dtrain.compile(spec)
    assert plan.tables
    job = replica_job(spec, plan, 0)
    check_self_contained(job)
    assert job.tables == plan.tables
    for slot, shard in zip(job.shards, plan.shards, strict=True):
        assert dict(slot.tables) == {t.name: t.dim for t in plan.tables if shard.index < len(t.parts)}
    assert job.settings.overlap is spec.training.overlaps(tables=True)
    assert job.data is not None and job.data.memory is not None and job.data.memory.id_rows is not None


def test_a_streaming_replica_gets_only_its_own_shards():
    spec = load("stream_parquet")
    plan = dtrain.compile(spec, data=file_input(spec, with_stats=False))
    assert plan.data is not None
    jobs = [replica_job(spec, plan, r) for r in range(plan.num_replicas)]
    for r, job in enumerate(jobs):
        check_self_contained(job)
        assert job.data is not None and job.data.memory is None
        stream = job.data.stream
        assert stream is not None
        assert stream.parts == plan.data.replicas[r].parts
        assert stream.layout == stream_layout(spec, plan, r) and stream.layout.replica == r
        assert (stream.format, stream.schema, stream.partitions) == (plan.data.format, plan.data.schema, b"")
        assert (stream.readers, stream.prefetch, stream.skip_bad_files) == (2, 4, spec.data.skip_bad_files)
    assert not set(jobs[0].data.stream.parts) & set(jobs[1].data.stream.parts)  # type: ignore[union-attr]


def test_a_pipeline_stage_gets_its_own_shards_layers_and_link():
    """Two pipeline replicas of two stages over two ps tasks: each stage task's job holds its own
    shards (numbered from 0 in its layout), its layers, the link to the next stage, and data only
    for the first stage."""
    spec = load("digits_model_parallel", "cluster.jobs.worker=4", "cluster.jobs.ps=2",
                "placement.variables=partitioned", "placement.min_slice_bytes=1")
    plan = dtrain.compile(spec)
    assert (plan.num_replicas, plan.stage_positions) == (2, 2)
    for r in range(plan.num_replicas):
        for p in range(plan.stage_positions):
            job = stage_job(spec, plan, r, p)
            check_self_contained(job)
            assert job.stage is not None and (job.index, job.stage.position, job.stage.positions) == (r, p, 2)
            ids = stage_shards(plan, p)
            assert [s.index for s in job.shards] == ids and len(ids) >= 1
            local = {g: i for i, g in enumerate(ids)}
            parts = [v for v in plan.variables if v.shard in local]
            assert [(q.shard, q.offset, q.param) for q in job.parts] == [(local[v.shard], v.offset, v.source)
                                                                        for v in parts]
            assert job.stage.devices == tuple((s.device, s.members) for s in plan.stages if s.position == p)
            assert job.stage.link == (link_shape(spec, plan, p) if p == 0 else None)
            assert (job.data is not None) == (p == 0) and job.tables == ()
    assert link_shape(spec, plan, 0) is not None


def test_the_job_is_the_same_on_any_workers():
    """A job holds nothing of where the tasks run: a recovery or an elastic change that puts the
    plan on other workers gives every replica the same job."""
    spec = load("digits_sync")
    alone = dtrain.compile(spec)
    workers = {f"tcp://10.0.0.{n}:1": {"name": name} for n, name in enumerate(["ps-0", "worker-0", "worker-1"])}
    placed = dtrain.compile(spec, workers)
    assert placed.replicas[0].address is not None and alone.replicas[0].address is None
    assert replica_job(spec, alone, 0) == replica_job(spec, placed, 0)
