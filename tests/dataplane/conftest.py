"""The data plane's fixtures: an event loop on its own thread, and each test run with and without
the shared-memory slots (skipped where /dev/shm is missing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.helpers.dataplane import HAS_SHM


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


@pytest.fixture(params=[True, False], ids=["shm", "tcp"])
def shm(request):
    if request.param and not HAS_SHM:
        pytest.skip("no /dev/shm on this machine")
    return request.param
