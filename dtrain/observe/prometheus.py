"""The run's telemetry as Prometheus series (docs/observability.md, "Prometheus").

The chief logs each interval's figures as one payload per run; the scheduler plugin keeps the
latest and this module turns them into metric families on every scrape of the scheduler's own
``/metrics``. The figures are cumulative on the replicas and shards already, so a scrape reads
them as they are: no state here, nothing to reset, and a scheduler that restarts simply starts
from the chief's next payload.

``families`` is pure (payloads in, families out) so the naming and the labels are tested without
HTTP. A payload is data from another process (its lists arrive as tuples: distributed's msgpack):
a missing or ``None`` figure is left out, and a malformed replica, shard or run is logged at debug
level and skipped, never raised into the scrape.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .meters import figure as _num

logger = logging.getLogger(__name__)

RUN = ("run", "name")  # the run's id (one per start or resume of a pipeline) and the pipeline's name
REPLICA = ("run", "job", "task", "replica")
SHARD = ("run", "job", "task", "shard")

# name (counters without "_total": prometheus_client appends it), type, help, labels
_SPECS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "dtrain_global_step": ("gauge", "The run's global step", RUN),
    "dtrain_loss": ("gauge", "The run's latest training loss", RUN),
    "dtrain_findings": ("gauge", "Diagnosis findings (straggler, hot shard, input-bound, staleness)", RUN),
    "dtrain_replica_steps": ("counter", "Local steps a replica took", REPLICA),
    "dtrain_replica_steps_per_second": ("gauge", "A replica's local steps per second over the interval", REPLICA),
    "dtrain_replica_seconds": ("counter", "A replica's seconds in compute, data and ps waits", REPLICA + ("phase",)),
    "dtrain_replica_bytes_sent": ("counter", "Gradient bytes a replica pushed", REPLICA),
    "dtrain_replica_bytes_received": ("counter", "Parameter bytes a replica pulled", REPLICA),
    "dtrain_shard_pushes": ("counter", "Gradients a ps shard received", SHARD),
    "dtrain_shard_applies": ("counter", "Optimizer updates a ps shard applied", SHARD),
    "dtrain_shard_dropped": ("counter", "Pushes a ps shard dropped as stale", SHARD),
    "dtrain_shard_applies_per_second": ("gauge", "A ps shard's updates per second over the interval", SHARD),
    "dtrain_shard_busy_ratio": ("gauge", "Share of the wall time a ps shard spent applying and copying", SHARD),
    "dtrain_shard_bytes_in": ("counter", "Gradient bytes into a ps shard", SHARD),
    "dtrain_shard_bytes_out": ("counter", "Parameter bytes out of a ps shard", SHARD),
    "dtrain_shard_staleness": ("histogram", "Global steps between a push's pull and its apply", SHARD),
    "dtrain_table_rows": ("gauge", "Rows a ps shard holds of a table", SHARD + ("table",)),
    "dtrain_table_bytes": ("gauge", "Bytes of a table's rows, optimizer state and index on a ps shard",
                           SHARD + ("table",)),
    "dtrain_table_admitted": ("counter", "Ids a ps shard admitted to a table without a vocabulary",
                              SHARD + ("table",)),
    "dtrain_table_evicted": ("counter", "Rows a ps shard evicted from a table without a vocabulary",
                             SHARD + ("table",)),
    "dtrain_table_rejected": ("counter", "Row gradients a ps shard dropped for ids not admitted",
                              SHARD + ("table",)),
}
_TABLE_KEYS = {"live_rows": "dtrain_table_rows", "bytes": "dtrain_table_bytes", "admitted": "dtrain_table_admitted",
               "evicted": "dtrain_table_evicted", "rejected": "dtrain_table_rejected"}

# payload key -> series, for the plain per-replica and per-shard figures
_REPLICA_KEYS = {"steps": "dtrain_replica_steps", "steps_per_s": "dtrain_replica_steps_per_second",
                 "bytes_sent": "dtrain_replica_bytes_sent", "bytes_recv": "dtrain_replica_bytes_received"}
_PHASES = {"compute": "compute_s", "data": "data_s", "ps": "ps_s"}
_SHARD_KEYS = {"pushes": "dtrain_shard_pushes", "applies": "dtrain_shard_applies",
               "dropped": "dtrain_shard_dropped", "applies_per_s": "dtrain_shard_applies_per_second",
               "busy_frac": "dtrain_shard_busy_ratio", "bytes_in": "dtrain_shard_bytes_in",
               "bytes_out": "dtrain_shard_bytes_out"}

_JOB, _TASK = re.compile(r"/job:([^/]+)"), re.compile(r"/task:([^/]+)")

# A sample before it becomes a family: (series, label values, value) or, for the histogram,
# (series, label values, (buckets, sum)).
_Sample = tuple[str, tuple[str, ...], Any]


def parse_task(task: Any) -> tuple[str, str]:
    """``"/job:worker/task:1"`` -> ``("worker", "1")`` (a ``/replica:0`` between them is allowed);
    a missing task gives ``("", "")``, a part the string lacks an empty label."""
    if not isinstance(task, str):
        return "", ""
    job, index = _JOB.search(task), _TASK.search(task)
    return (job[1] if job else ""), (index[1] if index else "")


def _histogram(stale: Any) -> tuple[list[tuple[str, float]], float | None] | None:
    """Cumulative buckets (``le`` as Prometheus writes it, ``+Inf`` last) and the sum, from a
    shard's ``staleness``; None where the shard has none (a sync run)."""
    if stale is None:
        return None
    le, counts = stale["le"], stale["counts"]
    maybe_bounds = [_num(b) for b in le]
    maybe_per = [_num(c) for c in counts]
    bounds = [b for b in maybe_bounds if b is not None]
    per = [c for c in maybe_per if c is not None]
    if len(bounds) != len(maybe_bounds) or len(per) != len(maybe_per) \
            or len(per) not in (len(bounds), len(bounds) + 1) or bounds != sorted(bounds):
        raise ValueError(f"staleness le={le!r} counts={counts!r}")
    buckets, total = [], 0.0
    for bound, count in zip(bounds, per[:len(bounds)], strict=True):
        total += count
        buckets.append((floatToGoString(bound), total))
    total += sum(per[len(bounds):])  # the last bucket: above the largest bound
    buckets.append(("+Inf", total))
    mean = _num(stale.get("mean"))
    return buckets, (None if mean is None else mean * total)


def _run_samples(run: str, payload: dict) -> list[_Sample]:
    out: list[_Sample] = []
    name = payload.get("name")
    labels = (run, name if isinstance(name, str) else "")
    for key, series in (("step", "dtrain_global_step"), ("loss", "dtrain_loss")):
        if (v := _num(payload.get(key))) is not None:
            out.append((series, labels, v))
    if isinstance(payload.get("diagnosis"), (list, tuple)):
        out.append(("dtrain_findings", labels, float(len(payload["diagnosis"]))))
    return out


def _replica_samples(run: str, index: str, replica: dict) -> list[_Sample]:
    labels = (run, *parse_task(replica.get("task")), str(index))
    out: list[_Sample] = [(series, labels, v) for key, series in _REPLICA_KEYS.items()
                          if (v := _num(replica.get(key))) is not None]
    out += [("dtrain_replica_seconds", (*labels, phase), v) for phase, key in _PHASES.items()
            if (v := _num(replica.get(key))) is not None]
    return out


def _shard_samples(run: str, index: str, shard: dict) -> list[_Sample]:
    labels = (run, *parse_task(shard.get("task")), str(index))
    out: list[_Sample] = [(series, labels, v) for key, series in _SHARD_KEYS.items()
                          if (v := _num(shard.get(key))) is not None]
    try:  # a malformed histogram costs the histogram, not the shard's other series
        hist = _histogram(shard.get("staleness"))
    except Exception as exc:
        logger.debug("dtrain telemetry: skipping shard %r's staleness in run %r (%s: %s)",
                     index, run, type(exc).__name__, exc)
        hist = None
    if hist is not None:
        out.append(("dtrain_shard_staleness", labels, hist))
    for table, figures in (shard.get("tables") or {}).items():
        name = str(table).removeprefix("tables.").removesuffix(".weight")
        out += [(series, (*labels, name), v) for key, series in _TABLE_KEYS.items()
                if (v := _num(figures.get(key))) is not None]
    return out


def _guarded(what: str, build: Callable[[], list[_Sample]]) -> list[_Sample]:
    """One part's samples, or none where the part is malformed (logged, never raised)."""
    try:
        return build()
    except Exception as exc:
        logger.debug("dtrain telemetry: skipping malformed %s (%s: %s)", what, type(exc).__name__, exc)
        return []


def _samples(run: str, payload: Any) -> list[_Sample]:
    if not isinstance(payload, dict):
        logger.debug("dtrain telemetry: skipping run %r: its payload is a %s", run, type(payload).__name__)
        return []
    out = _guarded(f"run {run!r}", lambda: _run_samples(run, payload))
    for section, build in (("replicas", _replica_samples), ("shards", _shard_samples)):
        entries = payload.get(section)
        if entries is None:
            continue
        if not isinstance(entries, dict):
            logger.debug("dtrain telemetry: skipping run %r's %s: a %s", run, section, type(entries).__name__)
            continue
        for index, entry in entries.items():
            out += _guarded(f"{section}[{index!r}] of run {run!r}", _deferred(build, run, index, entry))
    return out


def _deferred(build: Callable[[str, str, dict[str, Any]], list[_Sample]], run: str, index: str,
              entry: Any) -> Callable[[], list[_Sample]]:
    """``build``'s samples of one entry, built when called (inside :func:`_guarded`)."""
    return lambda: build(run, index, dict(entry))


_Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


def _empty() -> dict[str, _Family]:
    made: dict[str, _Family] = {}
    for name, (kind, doc, labels) in _SPECS.items():
        cls: type[_Family] = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}[kind]
        made[name] = cls(name, doc, labels=list(labels))
    return made


def families(payloads: dict[str, dict]) -> list[Metric]:
    """Every dtrain series for the given runs' latest payloads (``{run: payload}``), one family
    per series name (the table in docs/observability.md), families without samples left out."""
    made = _empty()
    for run, payload in sorted(payloads.items(), key=lambda kv: str(kv[0])):
        for series, labels, value in _samples(str(run), payload):
            family = made[series]
            if isinstance(family, HistogramMetricFamily):
                family.add_metric(list(labels), value[0], value[1])
            else:  # NaN and infinities too: Prometheus takes them, and a diverged loss is news
                family.add_metric(list(labels), value)
    return [f for f in made.values() if f.samples]


class TelemetryCollector:
    """A ``prometheus_client`` collector over a source of ``{run: payload}`` (the live plugins')."""

    def __init__(self, source: Callable[[], dict[str, dict]]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        try:
            payloads = self._source()
        except Exception:  # a scrape must answer whatever the plugins hold
            logger.debug("dtrain telemetry: reading the payloads failed", exc_info=True)
            return
        yield from families(payloads)

    def describe(self) -> Iterator[Metric]:
        """The names this collector owns, so the registry can refuse a clash without a collect."""
        yield from _empty().values()
