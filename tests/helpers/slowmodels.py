"""A model whose forward is slow on one worker only: a straggler for the backup-replica test.

Imported by path (``tests.helpers.slowmodels:SlowMLP``) on the in-process workers."""

from __future__ import annotations

import time

import torch
from torch import nn

SLOW_WORKER = "worker-2"


def _worker_name() -> str | None:
    try:
        from distributed import get_worker

        return str(get_worker().name)
    except ValueError:  # not inside a Dask task (the client builds and evaluates the model too)
        return None


class SlowMLP(nn.Module):
    """A small MLP; its forward sleeps ``delay_s`` on the Dask worker named ``slow_worker`` and
    ``fast_delay_s`` on the others (so the fast replicas do not finish before the slow one's
    first push arrives)."""

    def __init__(self, features: int = 64, hidden: int = 16, classes: int = 10, delay_s: float = 0.05,
                 slow_worker: str = SLOW_WORKER, fast_delay_s: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.delay_s = delay_s
        self.slow_worker = slow_worker
        self.fast_delay_s = fast_delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            worker = _worker_name()
            if worker == self.slow_worker:
                time.sleep(self.delay_s)
            elif worker is not None and self.fast_delay_s:
                time.sleep(self.fast_delay_s)
        return self.net(x)


class SlowStart(nn.Module):
    """A small MLP in three children (``first``, ``act``, ``head``) whose constructor sleeps
    ``delay_s`` on the Dask worker named ``slow_worker`` (a stage whose start is slow: a large
    stage, a cold first shard). The workers that slept are appended to ``SLEPT``."""

    SLEPT: list[str] = []

    def __init__(self, features: int = 64, hidden: int = 16, classes: int = 10, delay_s: float = 1.0,
                 slow_worker: str = "worker-0"):
        super().__init__()
        self.first = nn.Linear(features, hidden)
        self.act = nn.Tanh()
        self.head = nn.Linear(hidden, classes)
        worker = _worker_name()
        if worker == slow_worker:
            time.sleep(delay_s)
            SlowStart.SLEPT.append(worker)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.first(x)))
