"""Where each replica is in its data, for checkpoints, summaries and the progress bar.

A replica's position is the number of batches it has taken (the local step the ps records with
each push). With ``data.epochs`` it ends at ``epochs x batches per epoch``; for a sharded dataset
the position also names the epoch, the shard and the row where reading resumes
(:meth:`~dtrain.data.stream.StreamLayout.locate`). Pure bookkeeping over the session's counters.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec
from dtrain.worker.inputs import stream_layout


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


def _local(session: Any, index: int) -> int:
    return int(session.local_steps.get(index, session.local_steps.get(str(index), 0)))


def positions(session: Any, step: int) -> dict[str, Any]:
    """A checkpoint's record of each replica's place in a sharded dataset: epoch, batch, and the
    shard (by name) and row offset where its reading resumes."""
    plan, spec = session.plan, session.spec
    if plan.data is None:
        return {}
    out = {}
    for r in plan.replicas:
        # In sync without backups replica r's k-th batch is in step k: the snapshot's step says where
        # it is (the session's polled step may lag it); otherwise the local step it last reported.
        batch = step if plan.lockstep else _local(session, r.index)
        total = total_batches(spec, plan, r.index)
        batch = batch if total is None else min(batch, total)
        place = stream_layout(spec, plan, r.index).locate(batch)
        place["shard"] = plan.data.replicas[r.index].shards[place["shard"]]
        out[str(r.index)] = {"position": batch, **place}
    return {"data": out}


def epochs_done(session: Any) -> float | None:
    """Epochs every replica has completed (the slowest's), fractional; None when unknown."""
    plan, spec = session.plan, session.spec
    if plan.data is None and spec.data.epochs is None:
        return None
    done = []
    for r in plan.replicas:
        stats = session.replica_stats[r.index] if len(session.replica_stats) > r.index else None
        if stats and "data" in stats.get("extra", {}):
            done.append(float(stats["extra"]["data"]["epochs"]))
            continue
        per = batches_per_epoch(spec, plan, r.index)
        done.append(_local(session, r.index) / per if per else 0.0)
    return round(min(done), 4) if done else None


def summary(session: Any) -> dict[str, Any]:
    """summary.json's data fields: ``epochs`` completed and, for a sharded dataset, the files skipped."""
    epochs = epochs_done(session)
    out: dict[str, Any] = {} if epochs is None else {"epochs": epochs}
    if session.plan.data is not None:
        bad = sorted({f for st in session.replica_stats for f in st.get("extra", {}).get("data", {})
                      .get("bad_files", [])})
        out["bad_files"] = bad
        out["data"] = {"source": session.plan.data.source, "shards": session.plan.data.shards,
                       "rows": session.plan.data.rows, "eval_shards": session.plan.data.eval_shards}
    return out


def progress(session: Any) -> dict[str, Any]:
    """For the progress bar: the epoch and, with data.epochs, the share of the data consumed."""
    epochs = epochs_done(session)
    if epochs is None:
        return {}
    out: dict[str, Any] = {"epoch": epochs}
    if session.spec.data.epochs:
        out["share"] = min(1.0, epochs / session.spec.data.epochs)
    return out


def retire_finished(session: Any) -> None:
    """Replicas that ended on their own read all their data (data.epochs): the others' sync steps
    stop waiting for them (``ShardGroup.retire``)."""
    if session.driver is not None:  # in-graph: the driver counts the steps
        return
    done = [r.index for r, f in zip(session.plan.replicas, session.replica_futures, strict=True)
            if f is not None and f.status == "finished" and r.index not in session.retired]
    if done:
        session.retired.update(done)
        session.shards.retire(done)


def chief_reader(session: Any) -> Any:
    """How the chief reads an evaluation shard: its file (None: the default), or a Dask collection's
    partition computed on the cluster."""
    if session.plan.data is None or session.plan.data.format != "dask":
        return None
    graphs = _graphs(session.plan.data.partitions)
    client = session.client

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
