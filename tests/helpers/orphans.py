"""After a chief was killed (SIGKILL, or a forced exit that skips its cleanup): the processes it
started, and the scratch directories they could not remove."""

from __future__ import annotations

import os
import tempfile
import time

import psutil


def alive(procs: dict[int, float]) -> list[int]:
    """The pids of ``{pid: create_time}`` still running (not a zombie, not a later process given a
    reused pid)."""
    out = []
    for pid, t in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == t and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: dict[int, float], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for the processes ``{pid: create_time}`` to end; the pids left."""
    deadline = time.monotonic() + timeout
    while True:
        left = alive(procs)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def family(pid: int) -> dict[int, float]:
    """``pid`` and its descendants now, as ``{pid: create_time}`` (a pid reused later is not theirs)."""
    p = psutil.Process(pid)
    return {q.pid: q.create_time() for q in [p, *p.children(recursive=True)]}


def purge_dask_scratch() -> list[str]:
    """Remove the Dask work directories whose process is gone (a killed chief's scheduler and
    workers cannot remove theirs), as the next Dask worker or scheduler to start would."""
    import dask
    from distributed.diskutils import WorkSpace

    base = dask.config.get("temporary-directory") or tempfile.gettempdir()
    path = os.path.join(base, "dask-scratch-space")
    return WorkSpace(path)._purge_leftovers() if os.path.isdir(path) else []
