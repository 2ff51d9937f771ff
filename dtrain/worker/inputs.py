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
from dtrain.data.shards import Shard, read_shard
from dtrain.data.stats import make_transform
from dtrain.data.stream import ShardStream, StreamLayout
from dtrain.errors import OutOfRange
from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

Reader = Callable[[Shard], tuple[np.ndarray, np.ndarray]]


class MemoryBatches:
    """Batches of an in-memory dataset (see the module docstring)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, spec: PipelineSpec, index: int, num_replicas: int,
                 start: int = 0):
        b = spec.data.batch_size
        self.x, self.y = x, y
        self.sampler = ShardIterator(len(x), b, index, num_replicas, spec.training.seed, shuffle=spec.data.shuffle)
        if start:
            self.sampler.seek(start)  # resume: the data order continues where it stopped
        self.epochs = spec.data.epochs
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


def stream_layout(spec: PipelineSpec, plan: Plan, index: int) -> StreamLayout:
    """Replica ``index``'s stream layout (also what the chief locates positions with)."""
    d = spec.data
    rep = plan.required_data().replicas[index]
    return StreamLayout(tuple(p.rows for p in rep.parts), d.batch_size, d.shuffle_buffer, spec.training.seed, index,
                        d.shuffle, d.epochs)


def file_reader(plan: Plan) -> Reader:
    """Reads a file shard of ``plan``'s sharded dataset."""
    schema = plan.required_data().schema

    def read(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
        assert schema is not None  # a plan of files carries their schema
        return read_shard(schema, shard)

    return read


class StreamBatches:
    """Batches streamed from the replica's shards (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, plan: Plan, index: int, device: torch.device, start: int = 0,
                 read: Reader | None = None):
        d = spec.data
        self.layout = stream_layout(spec, plan, index)
        self.device = device
        data = plan.required_data()
        self.stream = ShardStream(self.layout, data.replicas[index].parts, read or file_reader(plan),
                                  make_transform(data.stats), readers=d.readers, prefetch=d.prefetch,
                                  skip_bad=d.skip_bad_files, start=start,
                                  get_timeout_s=spec.training.call_timeout_s * 10)

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


def evaluate_stream(plan: Plan, evaluate: Callable[[torch.Tensor, torch.Tensor], dict[str, float]],
                    read: Reader | None = None) -> dict[str, float]:
    """``evaluate`` (mean loss and accuracy of the model on (x, y)) over the evaluation shards, read
    one at a time, weighted by their rows."""
    data = plan.required_data()
    read = read or file_reader(plan)
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
