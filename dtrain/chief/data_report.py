"""Where each replica is in its data, for checkpoints, summaries and the progress bar.

A replica's position is the number of batches it has taken (the local step the ps records with
each push). With ``data.epochs`` it ends at ``epochs x batches per epoch``; for a sharded dataset
the position also names the epoch, the shard and the row where reading resumes
(:meth:`~dtrain.data.stream.StreamLayout.locate`). Pure bookkeeping over the run's state
(``chief/context.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from dtrain.plan.compiler import Plan
from dtrain.plan.job import stream_layout
from dtrain.spec.pipeline import PipelineSpec

from .context import RunState


def batches_per_epoch(spec: PipelineSpec, plan: Plan, index: int) -> int:
    """Replica ``index``'s batches per epoch."""
    if plan.data is not None:
        return stream_layout(spec, plan, index).batches_per_epoch
    from dtrain.worker.replica import dataset_for

    return len(dataset_for(spec).x_train) // (spec.data.batch_size * plan.num_replicas)


def total_batches(spec: PipelineSpec, plan: Plan, index: int) -> int | None:
    """The batches replica ``index`` takes in all (None: unbounded, no data.epochs)."""
    if spec.data.epochs is None or spec.training.replication == "in_graph":
        return None
    return spec.data.epochs * batches_per_epoch(spec, plan, index)


def _local(state: RunState, index: int) -> int:
    local: dict[Any, int] = state.local_steps
    return int(local.get(index, local.get(str(index), 0)))


def positions(spec: PipelineSpec, state: RunState, step: int) -> dict[str, Any]:
    """A checkpoint's record of each replica's place in a sharded dataset: epoch, batch, and the
    shard (by name) and row offset where its reading resumes."""
    plan = state.plan
    if plan.data is None:
        return {}
    out = {}
    for r in plan.replicas:
        # In sync without backups replica r's k-th batch is in step k: the snapshot's step says where
        # it is (the session's polled step may lag it); otherwise the local step it last reported.
        batch = step if plan.lockstep else _local(state, r.index)
        total = total_batches(spec, plan, r.index)
        batch = batch if total is None else min(batch, total)
        place: dict[str, Any] = dict(stream_layout(spec, plan, r.index).locate(batch))
        place["shard"] = plan.data.replicas[r.index].shards[place["shard"]]  # its name
        out[str(r.index)] = {"position": batch, **place}
    return {"data": out, "data_layout": data_layout(spec, plan)}


def data_layout(spec: PipelineSpec, plan: Plan) -> dict[str, Any] | None:
    """What a sharded dataset's positions index, per replica: its shards (names) and their rows,
    and the batch size, shuffle window, shuffle and seed its stream is cut with (None: data in
    memory). A checkpoint keeps it beside the positions; a resume compares (:func:`layout_change`)."""
    if plan.data is None:
        return None
    out = {}
    for r in plan.replicas:
        lay = stream_layout(spec, plan, r.index)
        out[str(r.index)] = {"shards": list(plan.data.replicas[r.index].shards), "rows": list(lay.rows),
                             "batch_size": lay.batch_size, "window": lay.window, "shuffle": lay.shuffle,
                             "seed": lay.seed}
    return out


def layout_change(written: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """Why positions recorded under the data layout ``written`` would index other samples under
    ``now`` (the first difference, in words), or None (the same, or a checkpoint without one)."""
    if written is None:
        return None
    if now is None:
        return "it was written reading a sharded dataset, the pipeline now reads its data in memory"
    if sorted(written, key=int) != sorted(now, key=int):
        return f"it holds the positions of {len(written)} replica(s), the plan has {len(now)}"
    for index in sorted(now, key=int):
        a, b = written[index], now[index]
        for key in ("shards", "rows", "batch_size", "window", "shuffle", "seed"):
            if a.get(key) != b.get(key):
                what = {"shards": "read the files", "rows": "read files of", "batch_size": "took batches of",
                        "window": "shuffled in windows of", "shuffle": "had shuffle", "seed": "had the seed"}[key]
                return (f"replica {index} {what} {_brief(a.get(key))} when it was written and would now "
                        f"{'read' if key in ('shards', 'rows') else 'use'} {_brief(b.get(key))}")
    return None


def _brief(value: Any) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(str, value[:3]))}, ... ({len(value)} in all)]"
    return str(value)


def epochs_done(spec: PipelineSpec, state: RunState) -> float | None:
    """Epochs every replica has completed (the slowest's), fractional; None when unknown."""
    plan = state.plan
    if plan.data is None and spec.data.epochs is None:
        return None
    done = []
    for r in plan.replicas:
        stats = state.replica_stats[r.index] if len(state.replica_stats) > r.index else None
        if stats and "data" in stats.get("extra", {}):
            done.append(float(stats["extra"]["data"]["epochs"]))
            continue
        per = batches_per_epoch(spec, plan, r.index)
        done.append(_local(state, r.index) / per if per else 0.0)
    return round(min(done), 4) if done else None


def summary(spec: PipelineSpec, state: RunState) -> dict[str, Any]:
    """summary.json's data fields: ``epochs`` completed and, for a sharded dataset, the files skipped."""
    epochs = epochs_done(spec, state)
    plan = state.plan
    out: dict[str, Any] = {} if epochs is None else {"epochs": epochs}
    if plan.data is not None:
        bad = sorted({f for st in state.replica_stats for f in st.get("extra", {}).get("data", {})
                      .get("bad_files", [])})
        out["bad_files"] = bad
        out["data"] = {"source": plan.data.source, "shards": plan.data.shards,
                       "rows": plan.data.rows, "eval_shards": plan.data.eval_shards}
    return out


def progress(spec: PipelineSpec, state: RunState) -> dict[str, Any]:
    """For the progress bar: the epoch and, with data.epochs, the share of the data consumed."""
    epochs = epochs_done(spec, state)
    if epochs is None:
        return {}
    out: dict[str, Any] = {"epoch": epochs}
    if spec.data.epochs:
        out["share"] = min(1.0, epochs / spec.data.epochs)
    return out


def chief_reader(plan: Plan, client: Any) -> Any:
    """How the chief reads an evaluation shard: its file (None: the default), or a Dask collection's
    partition computed on the cluster (by ``client``)."""
    if plan.data is None or plan.data.format != "dask":
        return None
    graphs = _graphs(plan.data.partitions)

    def read(shard: Any) -> Any:
        future = client.compute(graphs[shard.part])
        try:
            return future.result()
        finally:
            future.release()

    return read


@lru_cache(maxsize=2)
def _graphs(blob: bytes) -> dict[int, Any]:
    import cloudpickle

    return cloudpickle.loads(blob)
