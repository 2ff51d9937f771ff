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
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.inputs import stream_layout

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
    return {"data": out}


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
