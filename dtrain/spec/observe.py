"""``observe:``: the run's own measurements and the thresholds of its diagnosis.

The replicas and the ps shards count where their time and bytes go (``dtrain.observe.meters``);
the chief turns the counts into per-interval figures, names stragglers, hot shards, input-bound
replicas and harmful staleness (``dtrain.observe.diagnosis``), and serves them to metrics.jsonl,
TensorBoard, summary.json, Prometheus and a dashboard page (docs/observability.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ObserveSpec(BaseModel):
    """Telemetry and diagnosis (docs/observability.md): of between_graph replicas and their ps shards; a
    key set here is refused under ``replication: in_graph`` and in a graph pipeline (no replica loop)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    telemetry: bool = Field(True, strict=True, description="Measure per-replica and per-shard time, bytes and "
                            "staleness, and report them (metrics.jsonl, TensorBoard, summary.json, Prometheus, "
                            "the dashboard's /dtrain page) with a diagnosis. false: none of it (the overhead's "
                            "baseline).")
    interval_s: float = Field(2.0, ge=0.1, le=3600, description="Seconds between telemetry records (at most "
                              "one per summary record) and between the replicas' reports.")
    straggler_ratio: float = Field(0.5, gt=0, lt=1, description="A replica whose step rate is below this share of "
                                   "the median replica's is named a straggler.")
    hot_busy: float = Field(0.8, gt=0, le=1, description="A ps shard busy (applying, copying replies) more than "
                            "this share of the time is named hot.")
    hot_bytes_ratio: float = Field(2.0, gt=1, description="A ps shard moving more than this many times the mean "
                                   "bytes per shard is named hot (needs 3 or more shards to be possible).")
    input_bound: float = Field(0.2, gt=0, lt=1, description="A replica waiting for data more than this share of "
                               "its time is named input-bound.")
    max_mean_staleness: float | None = Field(None, ge=0, description="Async: a mean staleness (global steps between "
                                             "a push's pull and its apply) above this is reported, with its cost to "
                                             "the loss. Default: twice the replicas.")
