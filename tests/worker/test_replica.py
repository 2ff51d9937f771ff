"""The replica's process-level helpers."""

from __future__ import annotations

import os
import threading

import pytest

import dtrain
from dtrain.plan.compiler import compile as compile_plan
from dtrain.plan.job import replica_job
from dtrain.worker import replica as replica_mod
from dtrain.worker.replica import pin_compute_thread, run_replica
from tests.helpers.paths import PIPELINES


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_compute_thread_pins_only_the_calling_thread():
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def replica(rank: int) -> None:
        before = os.sched_getaffinity(0)
        seen[f"cpus{rank}"] = pin_compute_thread(rank, threads=1)
        seen[f"now{rank}"] = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, before)

    for rank in (0, 1, len(allowed)):
        t = threading.Thread(target=replica, args=(rank,))
        t.start()
        t.join()
    assert seen["cpus0"] == seen["now0"] == [allowed[0]]
    assert seen["cpus1"] == [allowed[1 % len(allowed)]]
    assert seen[f"cpus{len(allowed)}"] == [allowed[0]]  # wraps around
    assert sorted(os.sched_getaffinity(0)) == allowed  # this thread was never pinned


def test_data_plane_handles_open_after_the_model_and_the_data(monkeypatch):
    """Reliability M3: a replica opens its socket connections once its model is built and its
    data loaded, so they never sit idle through a slow start (the ps used to drop them)."""
    spec = dtrain.load(PIPELINES / "digits_async.yaml")
    plan = compile_plan(spec)
    events: list[str] = []
    real_load = replica_mod.load_memory

    def load_memory(args):
        data = real_load(args)
        events.append("data loaded")
        return data

    class Opened(Exception):
        pass

    def open_handles():
        events.append("connect")
        raise Opened

    monkeypatch.setattr(replica_mod, "load_memory", load_memory)
    with pytest.raises(Opened):
        run_replica(replica_job(spec, plan, 0), open_handles, owns_replies=True)
    assert events == ["data loaded", "connect"]


def test_a_replica_waiting_for_a_ps_stops_within_a_second_once_abandoned():
    """A replica blocked on a ps reply (a sync barrier, up to call_timeout_s + barrier_timeout_s)
    asks ``abandoned`` every second of the wait: once its chief is gone it stops (Abandoned), not
    after the timeout."""
    import time
    from concurrent.futures import Future

    spec = dtrain.load(PIPELINES / "digits_sync.yaml")
    plan = compile_plan(spec)
    gone_at = time.monotonic() + 0.5

    class Silent:  # a ps that never answers
        def pull(self, *args, **kwargs):
            return Future()

    t0 = time.monotonic()
    with pytest.raises(replica_mod.Abandoned):
        run_replica(replica_job(spec, plan, 0), [Silent() for _ in plan.shards],
                    abandoned=lambda: time.monotonic() > gone_at)
    assert time.monotonic() - t0 < 10  # (the timeout: 120 s)
