"""A replica's batches, and evaluation over streamed shards.

Two sources behind one interface (``next()`` -> (x, y) tensors, ``position``, ``info()``):

- :class:`MemoryBatches`: a dataset held in memory (synthetic, sklearn, one file): the seeded
  :class:`~dtrain.data.sampling.ShardIterator` slices, so the replicas' k-th batches together are
  a single process's k-th global batch;
- :class:`StreamBatches`: the replica's own shards of a sharded dataset
  (:class:`~dtrain.data.stream.ShardStream`: reader threads, shuffle window, prefetch).

With ``data.epochs`` either raises :class:`~dtrain.errors.OutOfRange` once the replica has
read its data that many times. Nothing here imports Dask: the reader of a Dask collection's
partitions comes from ``dtrain.worker.tasks``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dtrain.data.sampling import ShardIterator
from dtrain.data.shards import Manifest, Shard, read_shard
from dtrain.data.stats import make_transform
from dtrain.data.stream import ShardStream
from dtrain.errors import OutOfRange
from dtrain.plan.inputs import DataPlan
from dtrain.plan.job import ReplicaJob

Reader = Callable[[Shard], tuple[np.ndarray, np.ndarray]]


class MemoryBatches:
    """Batches of an in-memory dataset: replica ``job.index``'s slice (see the module docstring)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, job: ReplicaJob, start: int = 0):
        data = job.data
        assert data is not None  # (a job that reads data)
        b = data.batch_size
        self.x, self.y = x, y
        self.sampler = ShardIterator(len(x), b, job.index, data.replicas, job.settings.seed, shuffle=data.shuffle)
        if start:
            self.sampler.seek(start)  # resume: the data order continues where it stopped
        self.epochs = data.epochs
        # Two buffer pairs: a batch drawn ahead (peek) stays intact while the next is drawn.
        self._bufs = [(torch.empty((b, *x.shape[1:]), dtype=x.dtype, device=x.device),
                       torch.empty((b, *y.shape[1:]), dtype=y.dtype, device=y.device)) for _ in range(2)]

    @property
    def local_step(self) -> int:
        return self.sampler.local_step

    @property
    def position(self) -> int:
        return self.sampler.local_step

    def seek(self, local_step: int) -> None:
        self.sampler.seek(local_step)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.epochs is not None and self.sampler.local_step >= self.epochs * self.sampler.steps_per_epoch:
            raise OutOfRange(f"read {self.epochs} epoch(s)")
        xb, yb = self._bufs[self.sampler.local_step % 2]
        idx = torch.from_numpy(self.sampler.next_indices()).to(self.x.device)
        torch.index_select(self.x, 0, idx, out=xb)
        torch.index_select(self.y, 0, idx, out=yb)
        return xb, yb

    def info(self) -> dict[str, Any]:
        s = self.sampler
        return {"batches": s.local_step, "epochs": round(s.local_step / s.steps_per_epoch, 4)}

    def close(self) -> None:
        pass


def file_reader(schema: Manifest | None) -> Reader:
    """Reads a file shard of a sharded dataset whose files hold ``schema``'s columns."""

    def read(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
        assert schema is not None  # a plan of files carries their schema
        return read_shard(schema, shard)

    return read


class StreamBatches:
    """Batches streamed from the replica's shards (see the module docstring)."""

    def __init__(self, job: ReplicaJob, device: torch.device, start: int = 0, read: Reader | None = None):
        assert job.data is not None and job.data.stream is not None  # (a job of a sharded dataset)
        d = job.data.stream
        self.layout = d.layout
        self.device = device
        self.stream = ShardStream(self.layout, d.parts, read or file_reader(d.schema), make_transform(d.stats),
                                  readers=d.readers, prefetch=d.prefetch, skip_bad=d.skip_bad_files, start=start,
                                  get_timeout_s=job.settings.call_timeout_s * 10)

    @property
    def position(self) -> int:
        return self.stream.counters.batches

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.stream.next()
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def info(self) -> dict[str, Any]:
        c = self.stream.counters
        return {"batches": c.batches, "epochs": round(self.layout.epochs_done(c.batches), 4),
                "samples_read": c.samples, "bad_files": list(c.bad_files)}

    def close(self) -> None:
        self.stream.close()


def evaluate_stream(data: DataPlan, evaluate: Callable[[torch.Tensor, torch.Tensor], dict[str, float]],
                    read: Reader | None = None) -> dict[str, float]:
    """``evaluate`` (mean loss and accuracy of the model on (x, y)) over the evaluation shards of
    ``data`` (a plan's sharded dataset), read one at a time, weighted by their rows."""
    read = read or file_reader(data.schema)
    transform = make_transform(data.stats)
    sums: dict[str, float] = {}
    n = 0
    for shard in data.eval_parts:
        x, y = transform(*read(shard))
        if not len(x):
            continue
        for key, value in evaluate(torch.from_numpy(x), torch.from_numpy(y)).items():
            sums[key] = sums.get(key, 0.0) + value * len(x)
        n += len(x)
    return {key: value / n for key, value in sums.items()} if n else {}
