"""Colours and titles shared by the ``/dtrain`` page and ``dtrain report``'s plots, so a figure
reads the same in both (matplotlib's ``tab10`` colours, as hex for Bokeh)."""

from __future__ import annotations

TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GRAY, OLIVE, CYAN = TAB10

TRAIN_LOSS, EVAL_LOSS, ACCURACY = BLUE, ORANGE, GREEN
PHASE_COLORS = {"compute": BLUE, "data": ORANGE, "ps": RED}
BUSY, BYTES, STALE = PURPLE, GRAY, GREEN
CHECKPOINT, RECOVERY = GRAY, RED

TIME_PER_REPLICA = "Time per replica"
SHARD_LOAD = "Per-shard load"
STALENESS = "Staleness"
