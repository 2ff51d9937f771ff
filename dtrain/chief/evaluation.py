"""Evaluation on the chief: the model assembled from the ps's parameters (and table rows), scored on
the test split held in memory or streamed from the evaluation shards (``data.eval_source`` or a
seeded ``test_fraction`` of the shards). :class:`Evaluator` works from the run's context and state
(``chief/context.py``), the shard group and the session's metric sinks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtrain.model.build import build_model
from dtrain.model.metrics import AucHistogram
from dtrain.model.tables import tables_of
from dtrain.plan.compiler import Plan
from dtrain.plan.layout import ShardLayout
from dtrain.worker.inputs import evaluate_stream
from dtrain.worker.replica import dataset_for
from dtrain.worker.replica import evaluate as evaluate_on
from dtrain.worker.tables import evaluate_gathered

from . import data_report
from .context import RunContext, RunState
from .ps_shards import ShardGroup


class Evaluator:
    """Scores the model on the test data: every ``eval.every_steps`` and at the end. ``log`` writes
    a record to the run's metric sinks."""

    def __init__(self, ctx: RunContext, state: RunState, shards: ShardGroup,
                 log: Callable[[dict[str, Any], int], None]):
        self.ctx, self.state, self.shards, self.log = ctx, state, shards, log
        self.layout = ShardLayout.from_plan(state.plan)  # where each dense parameter lives on the ps
        self.table_names = {t.name for t in state.plan.tables}  # sparse tables: rows on the ps, not in the layout

    def now(self, step: int) -> dict[str, Any]:
        """Periodic evaluation (eval.every_steps): logged to the sinks and kept in the history."""
        tables = bool(self.state.plan.tables)  # gathered: each evaluation batch pulls only its rows
        model = self.assemble(build_model(self.ctx.spec, gathered_tables=tables),
                              self.shards.pull_params(for_eval=True), with_tables=False)
        result = self.evaluate(model)
        if result:
            self.log({"eval": result}, step)
            self.state.eval_history.append({"step": step, **result})
        return result

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        """Mean loss (and accuracy) of ``model`` on the test data; for binary labels (bce_with_logits)
        also ``log_loss`` (the mean loss, by its usual name) and ``auc``."""
        spec, plan = self.ctx.spec, self.state.plan
        assert spec.model is not None  # (a training pipeline's)
        loss, record = spec.model.loss, spec.model.module is not None
        auc = AucHistogram() if loss == "bce_with_logits" else None
        if any(getattr(t, "gathered", False) for _, t in tables_of(model)):
            def run(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
                return evaluate_gathered(model, x, y, loss, self.shards.gather_rows,
                                         record=record, auc=auc)
        else:
            def run(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
                return evaluate_on(model, x, y, loss, auc=auc)
        if plan.data is not None:  # streamed from the evaluation shards, one at a time
            result = evaluate_stream(plan.data, run, data_report.chief_reader(plan, self.ctx.client))
        else:
            data = dataset_for(spec)
            result = run(torch.as_tensor(data.x_test), torch.as_tensor(data.y_test))
        if auc is not None and result:
            result["log_loss"] = result["loss"]
            if (value := auc.value()) is not None:
                result["auc"] = value
        return result

    def assemble(self, model: torch.nn.Module, buffers: list[torch.Tensor], with_tables: bool = True
                 ) -> torch.nn.Module:
        """``model`` with the ps's parameters (and, ``with_tables``, the sparse tables' rows, whole)."""
        shapes = {n: p.shape for n, p in model.named_parameters() if n not in self.table_names}
        params = self.layout.unpack(buffers, shapes)
        if with_tables:  # whole tables (model.pt): fetched from the ps in chunks of rows
            for name, table in tables_of(model):
                if name in self.table_names:
                    if table.dynamic is not None:  # a table without a vocabulary: its ids and their rows
                        ids, rows = self.shards.pull_rows(name)
                        table.make_full(rows, ids)
                    else:
                        table.make_full(self.shards.pull_table(name))
        extra = {}
        stats = self.state.replica_stats
        if stats and stats[0].get("extra", {}).get("buffers"):
            extra = stats[0]["extra"]["buffers"]
        model.load_state_dict({**model.state_dict(), **params, **extra})
        return model


MODEL_PT_TABLE_BYTES = 2 << 30
"""The most float32 bytes of table rows ``model.pt`` holds whole (the chief assembles them in its
memory to write it); a model with larger tables gets a ``model.pt`` of its dense parameters, and its
tables stay in the checkpoints (docs/recommendation.md)."""


def tables_fit_model_pt(plan: Plan) -> bool:
    """Whether ``plan``'s tables are small enough for the chief to write them into ``model.pt``."""
    return sum(t.rows * t.dim * 4 for t in plan.tables) <= MODEL_PT_TABLE_BYTES
