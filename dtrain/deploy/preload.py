"""A Dask worker preload for the embedded cluster's worker processes: they ignore SIGINT, SIGTERM
and SIGHUP.

A terminal's Ctrl-C (and a dropped SSH session's SIGHUP, and systemd's default
``KillMode=control-group`` stop) signals every process of the foreground group or unit, the
embedded ps and worker processes included. Those must outlive the chief's handling of it: the
chief checkpoints (every shard held at one step), writes its summary, and only then stops the
cluster, whose nannies end these processes. A worker orphaned by a killed chief still exits by
itself (``death_timeout``). Workers started with ``dtrain worker`` keep Dask's own signal
handling (a process manager must be able to stop them).
"""

from __future__ import annotations

import signal
from typing import Any

IGNORED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def dask_setup(worker: Any) -> None:
    """Runs in the worker process's main thread (its event loop) as the worker starts."""
    for s in IGNORED:
        signal.signal(s, signal.SIG_IGN)
