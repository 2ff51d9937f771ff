"""The replica's process-level helpers."""

from __future__ import annotations

import os
import threading

import pytest

import dtrain
from dtrain.plan.compiler import compile as compile_plan
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
    real_dataset_for = replica_mod.dataset_for

    def dataset_for(s):
        data = real_dataset_for(s)
        events.append("data loaded")
        return data

    class Opened(Exception):
        pass

    def open_handles():
        events.append("connect")
        raise Opened

    monkeypatch.setattr(replica_mod, "dataset_for", dataset_for)
    with pytest.raises(Opened):
        run_replica(spec, plan, 0, open_handles, owns_replies=True)
    assert events == ["data loaded", "connect"]
