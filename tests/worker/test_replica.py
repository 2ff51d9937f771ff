"""The replica's process-level helpers."""

from __future__ import annotations

import os
import threading

import pytest

from dtrain.worker.replica import pin_compute_thread


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
