"""A stage listener no stage task claims (its run failed before the stage tasks started) is
closed on its own, on a real Dask worker, without waiting for another listener to open there."""

from __future__ import annotations

import socket
import time

import dtrain.worker.stage_tasks as stage_tasks


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False
    except TimeoutError:  # listening, its backlog full of these probes (nobody accepts them)
        return True


def test_an_unclaimed_stage_listener_is_closed_after_its_lifetime(inproc_client, monkeypatch):
    monkeypatch.setattr(stage_tasks, "UNCLAIMED_S", 0.5)  # (the in-process workers share this module)
    t0 = time.monotonic()
    worker = next(a for a, w in inproc_client.scheduler_info()["workers"].items() if w["name"] == "worker-3")
    host, port = inproc_client.submit(stage_tasks.open_stage_listener, "dtrain-stage-test-unclaimed", b"s" * 32,
                                      False, workers=[worker], pure=False).result(timeout=30)
    assert host == "127.0.0.1"
    assert _accepts(port) or time.monotonic() - t0 >= 0.5  # it did listen (unless already past its lifetime)
    deadline = time.monotonic() + 30
    while _accepts(port):  # nothing else opens a listener on that worker meanwhile
        assert time.monotonic() < deadline, "the unclaimed listener is still open"
        time.sleep(0.05)
    assert "dtrain-stage-test-unclaimed" not in stage_tasks._LISTENERS
