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

import logging
import signal
from typing import Any

IGNORED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class _QuietHeartbeat(logging.Filter):
    """Drops "Failed to communicate with scheduler during heartbeat" (an ERROR with a traceback).
    An embedded worker's scheduler lives in the chief's process, so the heartbeat fails only when
    the chief is closing the cluster (a race in Dask's shutdown: a heartbeat in flight as the
    scheduler goes) or has died (then ``death_timeout`` ends the worker): either way the chief
    says what happened, and the traceback on the user's terminal would only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to communicate with scheduler during heartbeat" not in record.getMessage()


def dask_setup(worker: Any) -> None:
    """Runs in the worker process's main thread (its event loop) as the worker starts."""
    for s in IGNORED:
        signal.signal(s, signal.SIG_IGN)
    logging.getLogger("distributed.worker").addFilter(_QuietHeartbeat())
