"""The data plane's tests' shared parts: whether this machine has /dev/shm, a small shard to serve.
(The fixtures, ``loop`` and ``shm``, are in tests/dataplane/conftest.py.)"""

from __future__ import annotations

import os

import torch

from dtrain.dataplane import shm as transport
from dtrain.ps.shard import ParameterShard

HAS_SHM = os.path.isdir(transport.SHM_DIR)


def make_shard(mode="async", n=1000, replicas=1, **kw):
    config = {"index": 0, "mode": mode, "steps": 10_000, "num_replicas": replicas,
              "optimizer": {"name": "sgd", "lr": 0.5}, "barrier_timeout_s": 5, **kw}
    return ParameterShard(config, torch.ones(n))
