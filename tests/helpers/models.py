"""Custom models used by tests (imported by path from pipelines, on the workers too)."""

from __future__ import annotations

import time

import torch
from torch import nn


class BrokenMLP(nn.Module):
    """A user's module with a bug that only real data shows: on real tensors its forward drops the
    last feature, so the replica fails with torch's own shape error. (A layer of the wrong width
    would be caught before start, by the forward on the meta device: chief/preflight.py.)"""

    def __init__(self, features: int = 64, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(features, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            x = x[..., :-1]
        return self.fc2(torch.relu(self.fc1(x)))


class TinyMLP(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Flat(nn.Module):
    """A regression module that returns (batch,), not (batch, 1)."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).squeeze(-1)


class TinyEmbedding(nn.Module):
    """A module with its own sparse nn.Embedding (a ps table; with ``padding_idx``, refused)."""

    def __init__(self, padding_idx: int | None = None, shift: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True, padding_idx=padding_idx)
        self.shift = shift  # added to every id: shift > 0 looks up rows outside the table
        self.out = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x.long() + self.shift).flatten(1))


class TwoTables(nn.Module):
    """Two sparse tables over different columns of the ids (a user and an item field, say), with
    the second field's ids shifted by the module itself: ps tables found by a record pass."""

    def __init__(self, vocab: int = 5000, dim: int = 4) -> None:
        super().__init__()
        self.users = nn.Embedding(vocab, dim, sparse=True)
        self.items = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True)
        self.dense = nn.Embedding(7, 2)  # sparse=False: an ordinary dense parameter
        self.head = nn.Sequential(nn.Linear(2 * dim + 2 + dim, 8), nn.ReLU(), nn.Linear(8, 1))
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        users = self.users(x[:, :2]).flatten(1)
        items = self.items((x[:, 2:] + 17) % self.vocab)
        return self.head(torch.cat([users, self.dense(x[:, 0] % 7), items], dim=1))


class RecordingMLP(nn.Module):
    """A tiny MLP that appends each training batch's first feature -- the sample ids of a test dataset
    (tests.helpers.shards, unstandardised) -- to a file in $DTRAIN_TEST_RECORD, one line per batch,
    one file per process and thread (one replica each): tests count what training consumed."""

    def __init__(self, features: int = 4, classes: int = 2, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        import threading

        where = os.environ.get("DTRAIN_TEST_RECORD")
        if where and self.training and x.device.type != "meta":
            with open(os.path.join(where, f"{os.getpid()}-{threading.get_ident()}.txt"), "a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.net(x)


class _Recorded(nn.Module):
    """A child that leaves a file named after itself, its process id and its device each time it
    runs forward in training mode on real tensors."""

    def __init__(self, name: str, inner: nn.Module, record_dir: str):
        super().__init__()
        self.name, self.record_dir, self.inner = name, record_dir, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        from pathlib import Path

        if self.training and x.device.type != "meta":
            (Path(self.record_dir) / f"{self.name}-{os.getpid()}-{x.device.type}").touch()
        return self.inner(x)


class StageRecorder(nn.Module):
    """Three children run in order (encoder, act, head), each recording where it runs: the test of
    pipeline stages compares those process ids with the worker tasks' own."""

    def __init__(self, record_dir: str, features: int = 64, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.encoder = _Recorded("encoder", nn.Linear(features, hidden), record_dir)
        self.act = _Recorded("act", nn.ReLU(), record_dir)
        self.head = _Recorded("head", nn.Linear(hidden, classes), record_dir)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.encoder(x)))


class Residual(nn.Module):
    """Children fc1, act, fc2 whose shapes chain, but the forward adds the input back: not a
    sequence of its children (pipeline stages must refuse it)."""

    def __init__(self, features: int = 64, classes: int = 64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Branches(nn.Module):
    """Two children applied to the same input: the second fails on the first's output."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


class CompactTable(nn.Module):
    """A module holding a ps table directly (dtrain.model.tables.Table) with its own storage dtype
    and optimizer: what ``dtrain plan`` and the ps memory check count for it. Plan and preflight
    only: a replica gathers the tables ``swap_embeddings`` makes, not one a module builds itself."""

    def __init__(self, vocab: int = 50, dim: int = 4, storage: str = "bfloat16",
                 optimizer: dict | None = None) -> None:
        super().__init__()
        from dtrain.model.tables import Table

        self.emb = Table(vocab, dim, name="emb.weight", storage=storage, optimizer=optimizer)
        self.out = nn.Linear(3 * dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).flatten(1))


class Factors(nn.Module):
    """Matrix factorisation with biases: user and item factors near 0.1, biases at zero, set by
    the module's own code; ``declare``: with dtrain_init saying so (else refused before start)."""

    def __init__(self, users: int = 30, items: int = 20, dim: int = 4, declare: bool = True) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(users, dim, sparse=True), nn.Embedding(items, dim, sparse=True)
        self.user_bias, self.item_bias = nn.Embedding(users, 1, sparse=True), nn.Embedding(items, 1, sparse=True)
        nn.init.normal_(self.users.weight, 0.0, 0.1)
        nn.init.normal_(self.items.weight, 0.0, 0.1)
        nn.init.zeros_(self.user_bias.weight)
        nn.init.zeros_(self.item_bias.weight)
        if declare:
            self.users.dtrain_init = self.items.dtrain_init = {"normal": 0.1}
            self.user_bias.dtrain_init = self.item_bias.dtrain_init = {"constant": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, i = x[:, 0].long(), x[:, 1].long()
        dot = (self.users(u) * self.items(i)).sum(-1)
        return dot + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1)


class FeatureNet(nn.Module):
    """A recommendation module fed by model.features: forward(dense, features) with each feature's
    (ids, offsets, weights); two sparse bags (one shared by C1 and C3) and a linear head."""

    def __init__(self, dense: int = 3, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.ModuleDict({"a": nn.EmbeddingBag(300, dim, mode="sum", sparse=True),
                                  "b": nn.EmbeddingBag(97, dim, mode="sum", sparse=True)})
        self.head = nn.Linear(dense + 3 * dim, 1)

    def forward(self, dense: torch.Tensor, features: dict) -> torch.Tensor:
        pooled = [self.emb[t](features[f][0], features[f][1], per_sample_weights=features[f][2])
                  for f, t in (("C1", "a"), ("C2", "b"), ("C3", "a"))]
        return self.head(torch.cat([dense, *pooled], dim=1)).squeeze(-1)


class SlowEval(nn.Module):
    """A digits MLP whose evaluation forward (``eval()`` mode) sleeps ``sleep_s`` per batch: an
    evaluation longer than a barrier timeout."""

    def __init__(self, sleep_s: float = 1.0, features: int = 64, classes: int = 10):
        super().__init__()
        self.sleep_s = sleep_s
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and x.device.type != "meta":
            time.sleep(self.sleep_s)
        return self.net(x)
