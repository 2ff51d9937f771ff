"""The counters a run keeps about itself: a ps shard's load, and a replica's throttled report.

Pure Python (no Dask, no torch): the replica's loop and the shard's methods add the timestamps
they already take; nothing here makes a call, allocates per step beyond a float add, or locks.
The chief reads snapshots (dicts of numbers, msgpack-safe) and turns them into rates per
interval (``dtrain.chief.telemetry``); the keys are documented in docs/observability.md.
"""

from __future__ import annotations

import math
import time
from typing import Any

# Staleness histogram: bucket upper bounds (global steps); the last bucket holds the rest.
STALENESS_LE = (0, 1, 2, 4, 8, 16, 32)


def staleness_bucket(staleness: int) -> int:
    """The histogram bucket of a push ``staleness`` global steps old."""
    for i, le in enumerate(STALENESS_LE):
        if staleness <= le:
            return i
    return len(STALENESS_LE)


_BUCKET = [staleness_bucket(s) for s in range(STALENESS_LE[-1] + 1)]  # a lookup per push, not a loop


def figure(value: Any) -> float | None:
    """A figure of a report or payload as a float; None where it is missing or not a number (a
    bool is not a figure). The diagnosis, the Prometheus series and the page read figures so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Every:
    """Hands ``snapshot()`` to ``publish`` at most every ``every_s`` seconds: a replica's report
    (a fire-and-forget event, no round trip), called from its loop once a step."""

    def __init__(self, publish: Any, every_s: float):
        self._publish = publish
        self._every = every_s
        self._last = time.perf_counter()

    def tick(self, now: float, snapshot: Any) -> None:
        if self._publish is not None and now - self._last >= self._every:
            self._last = now
            try:
                self._publish(snapshot())
            except Exception:  # telemetry never fails a replica (a closing worker, say)
                self._publish = None


class ShardMeter:
    """One ps shard's pushes, applies, busy seconds, payload bytes and staleness histogram.

    ``busy_s`` counts the work a push costs the shard (the optimizer's apply and the reply's
    snapshot copy), not the time a push waits at a barrier or gate. The staleness histogram
    also sums the losses the replicas reported per bucket: what staleness costs the loss."""

    def __init__(self, dense_bytes: int = 0) -> None:
        self.dense_bytes = dense_bytes  # the shard's gradient and parameters (float32), per push and reply
        self.pushes = self.applies = 0
        self.busy_s = 0.0
        self.bytes_in = self.bytes_out = 0
        n = len(STALENESS_LE) + 1
        self.counts = [0] * n
        self.loss_sum = [0.0] * n
        self.loss_n = [0] * n
        self.stale_sum = self.stale_max = 0
        self.t0 = time.perf_counter()

    def push(self, extra_bytes: int = 0, staleness: int | None = None, loss: float | None = None) -> None:
        """A push of the dense gradient and ``extra_bytes`` of table rows; async: its staleness and
        the loss its replica reported (shard 0)."""
        if not self.pushes:
            self.t0 = time.perf_counter()  # the shard's wall time counts from its first push
        self.pushes += 1
        self.bytes_in += self.dense_bytes + extra_bytes
        if staleness is not None:
            if staleness < 0:
                staleness = 0
            b = _BUCKET[staleness] if staleness < len(_BUCKET) else len(STALENESS_LE)
            self.counts[b] += 1
            self.stale_sum += staleness
            if staleness > self.stale_max:
                self.stale_max = staleness
            if loss is not None and math.isfinite(loss):
                self.loss_sum[b] += loss
                self.loss_n[b] += 1

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pushes": self.pushes, "applies": self.applies, "busy_s": self.busy_s,
                               "wall_s": time.perf_counter() - self.t0, "bytes_in": self.bytes_in,
                               "bytes_out": self.bytes_out}
        total = sum(self.counts)
        if total:
            out["staleness"] = {
                "le": list(STALENESS_LE), "counts": list(self.counts), "mean": self.stale_sum / total,
                "max": self.stale_max,
                "loss": [s / n if n else None for s, n in zip(self.loss_sum, self.loss_n, strict=True)]}
        return out
