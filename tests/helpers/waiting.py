"""One way for a test to wait for something to happen: ``wait_until``."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, what: str, *, every: float = 0.05,
               check: Callable[[], None] | None = None) -> None:
    """Poll ``predicate`` every ``every`` seconds until it holds; fail the test, naming ``what``,
    once ``timeout`` seconds pass without it. ``check``, called before each wait, may fail the test
    sooner (a process that ended, a run thread that died): it asserts what must stay true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)
