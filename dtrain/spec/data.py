"""The pipeline's ``data`` section: where the training samples come from and how they are read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict

STREAM_KEYS = ("readers", "prefetch", "shuffle_buffer", "skip_bad_files")
"""Keys that apply to a sharded source only (a glob, a directory, a URL: docs/data.md)."""


class DataSpec(Strict):
    """Training data: a synthetic problem, a bundled scikit-learn dataset, a file, or a sharded dataset
    (a glob, directory or URL of files) streamed by every replica."""

    source: str = Field(
        "synthetic",
        description="synthetic | sklearn:digits (also sklearn:iris, sklearn:wine, sklearn:breast_cancer, "
        "sklearn:diabetes) | path to .npz/.csv/.parquet, relative to the pipeline file | a glob, directory or "
        "fsspec URL (s3://..., gs://...) of .parquet/.csv/.npz shards, streamed (docs/data.md).",
    )
    epochs: int | None = Field(
        None, ge=1, le=1_000_000, description="Passes over the training data; then training ends (TensorFlow's "
        "OutOfRange) with the final checkpoint and evaluation. Default: unbounded (training.steps ends it).")
    readers: int = Field(2, ge=1, le=64, description="Sharded source: background threads reading shards per replica.")
    prefetch: int = Field(4, ge=1, le=1024, description="Sharded source: batches each replica keeps ready.")
    shuffle_buffer: int = Field(
        10_000, ge=1, le=100_000_000, description="Sharded source: samples shuffled together (a window of this "
        "many, read in the epoch's shuffled shard order; TensorFlow's min_after_dequeue). Bounds memory.")
    eval_source: str | None = Field(
        None, description="The evaluation data, instead of holding out test_fraction of data.source: a file like "
        "data.source (read the same way, standardised with the training statistics), or for a sharded source a "
        "glob, directory or URL of evaluation shards.")
    skip_bad_files: bool = Field(
        False, description="Sharded source: a shard that cannot be read mid-run is skipped with a warning and "
        "counted in summary.json (default: the run fails naming the file, after a checkpoint).")
    batch_size: int = Field(32, ge=1, description="Examples per replica per step.")
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share held out for evaluation (seeded, "
                                 "stratified; 0: none, the run has no evaluation unless eval_source is given). "
                                 "Ignored with eval_source.")
    standardize: bool = Field(True, description="Scale features with the training split's mean and std.")
    target: str = Field("label", description="Target column of .csv/.parquet files.")
    task: Literal["classification", "regression"] | None = Field(
        None, description="synthetic only: the kind of problem (default: from the loss)."
    )
    num_samples: int = Field(4096, ge=8, description="synthetic only: number of examples.")
    num_classes: int = Field(10, ge=2, description="synthetic classification only: number of classes.")
    shuffle: bool = Field(True, description="Reshuffle every epoch (seeded).")
