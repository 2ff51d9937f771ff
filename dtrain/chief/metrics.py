"""Metric sinks: ``metrics.jsonl`` and TensorBoard event files. Each has ``log(metrics, step)``
and ``close()``; the session (the chief) is the only writer."""

from __future__ import annotations

import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any

from .rundir import clean_json

logger = logging.getLogger(__name__)


class JsonlSink:
    """One JSON object per line; flushed at every write so a crash loses nothing."""

    def __init__(self, path: Path, append: bool = False):
        self.path = path
        self._f = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._f.write(json.dumps(clean_json({"step": step, **metrics}), sort_keys=False, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# The keys of dtrain's own records (and the eval/ tags): a user summary named like one would be read
# as (or drawn over) dtrain's own figure.
RESERVED_TAGS = frozenset({"step", "time", "loss", "samples_per_sec", "dropped_stale", "learning_rate", "replicas",
                           "samples", "eval", "replica_stats", "shard_stats"})


def check_summary(tag: Any, value: Any, step: Any) -> tuple[str, float, int]:
    """A user summary (``StepContext.summary``) as ``(tag, value, step)``; ValueError naming the
    bad argument and the fix otherwise. ``value``: a finite real number (a one-element tensor or
    array is read with ``.item()``)."""
    if not isinstance(tag, str) or not tag.strip():
        raise ValueError(f"summary tag must be a non-empty string such as 'my/accuracy', got {tag!r}")
    if tag in RESERVED_TAGS or tag.startswith("eval/"):
        raise ValueError(f"summary tag {tag!r} is one of dtrain's own metrics ({', '.join(sorted(RESERVED_TAGS))}, "
                         "eval/*); choose another name, e.g. 'my/" + tag.replace("eval/", "") + "'")
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()  # a one-element torch tensor or numpy array
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"summary {tag!r}: the value must be a finite number (int or float), got {value!r}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"summary {tag!r}: step must be a global step (an int >= 0) or None, got {step!r}")
    return tag, float(value), int(step)


class TensorBoardSink:
    """Scalars under ``tb/``: loss, learning rate, samples/s, dropped_stale, eval/*, and telemetry
    grouped per replica (``replica_0/steps_per_s``) and per shard (``shard_1/busy_frac``)."""

    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(path))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, dict):  # replica_stats/shard_stats: one group per replica and shard
                        for name, x in v.items():
                            if _scalar(x):
                                self._w.add_scalar(f"{key.removesuffix('_stats')}_{k}/{name}", x, step)
                    elif _scalar(v):
                        self._w.add_scalar(f"{key}/{k}", v, step)
            elif _scalar(value) and key not in ("time", "step"):
                self._w.add_scalar(key, value, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def format_line(step: int, metrics: dict[str, Any]) -> str:
    """The coordinator's aligned progress line: ``step 1200  loss 0.1432  acc 0.961  samples/s 5210  stale 3``."""
    parts = [f"step {step:>7}"]
    if metrics.get("loss") is not None:
        parts.append(f"loss {metrics['loss']:.4f}")
    ev = metrics.get("eval") or {}
    if ev.get("accuracy") is not None:
        parts.append(f"acc {ev['accuracy']:.3f}")
    if metrics.get("samples_per_sec") is not None:
        parts.append(f"samples/s {metrics['samples_per_sec']:>7.0f}")
    if metrics.get("dropped_stale") is not None:
        parts.append(f"stale {metrics['dropped_stale']}")
    return "  ".join(parts)
