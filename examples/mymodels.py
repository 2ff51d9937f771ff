"""A custom model and a custom hook, named by import path in a pipeline (see
custom_module_and_hook.py):

    model: {module: "examples.mymodels:Net", kwargs: {hidden: 48}}
    hooks: [{type: "examples.mymodels:StopBelowLoss", args: {threshold: 0.3}}]

The module must be importable wherever it is used: the model is built in the chief and on every
worker task, a hook only in the chief (the process that calls ``dtrain.run``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from torch import nn

import dtrain

if TYPE_CHECKING:
    from dtrain.chief.hooks import RunView, StepContext  # begin/end get a RunView; after_step a StepContext


class Net(nn.Module):
    """A digits MLP with a residual hidden block: any ``nn.Module`` (or factory) will do. Its
    parameter names (``inp.weight``, ``block.0.bias``, ...) are the variables sharded over the ps."""

    def __init__(self, features: int = 64, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.block(h))


class StopBelowLoss(dtrain.Hook):
    """Stops the run once the training loss (the mean over the newest summary interval) falls
    below ``threshold``, and writes what it saw to ``RUN_DIR/stop_below_loss.json``."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.seen: list[tuple[int, float]] = []  # (global step, loss) at each call that had a loss
        self.stopped_at: int | None = None

    def begin(self, run: RunView) -> None:
        # Runs once in the chief, before the replicas start; the run view knows the run directory.
        self.out = run.run_dir / "stop_below_loss.json"
        self.start_step = run.start_step

    def after_step(self, ctx: StepContext) -> None:
        loss = ctx.metrics.get("loss")  # empty until the first summary record arrives
        if loss is None:
            return
        self.seen.append((ctx.step, loss))
        if self.stopped_at is None and loss < self.threshold:
            self.stopped_at = ctx.step
            ctx.request_stop(f"loss {loss:.3f} < {self.threshold} at step {ctx.step}")

    def end(self, run: RunView) -> None:
        # Also called after a failure: the record is written whatever happened.
        self.out.write_text(json.dumps({
            "threshold": self.threshold, "start_step": self.start_step, "stopped_at": self.stopped_at,
            "final_step": run.step, "seen": self.seen,
        }, indent=1))


class CTRNet(nn.Module):
    """A click-through model with two sparse embedding tables, as recommenders build them: the
    first ``user_fields`` ids look up the user table, the others the item table (an
    ``nn.EmbeddingBag`` summing them). Built with ``sparse=True``, both live on the ps tasks as
    tables partitioned by rows (docs/sparse.md); only the rows a batch touches move."""

    def __init__(self, vocab: int = 100_000, dim: int = 16, user_fields: int = 4, fields: int = 8):
        super().__init__()
        self.user_fields = user_fields
        self.users = nn.Embedding(vocab, dim, sparse=True)
        self.items = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True)
        self.head = nn.Sequential(nn.Linear(user_fields * dim + dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        users = self.users(ids[:, :self.user_fields]).flatten(1)
        items = self.items(ids[:, self.user_fields:])
        return self.head(torch.cat([users, items], dim=1))
