"""The Dask settings and worker-process environment dtrain runs its workers with, apart from the
cluster (``dtrain.deploy.cluster``) so that the forkserver (``dtrain.deploy.forkserver``), which the
cluster starts, reads them without importing the cluster back."""

from __future__ import annotations

MALLOC_TRIM_THRESHOLD = 256 << 20
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit


# Dask's periodic housekeeping, at dtrain's pace (docs/performance.md, "Dask's own housekeeping"):
# - every Dask server (scheduler, nannies, workers) measures its event loop's latency with a
#   callback every tick: at Dask's 20 ms an idle embedded cluster of 1 ps + 2 workers burnt 130 ms
#   of CPU per second (6.5% of 2 cores, taken from the replicas), 55 ms at 500 ms (the value Dask's
#   own test suite uses). The tick only feeds the unresponsive-loop warning (``tick.limit``) and
#   the dashboard's event-loop plot;
# - each nanny and each worker reads its process's memory (psutil) every monitor interval (Dask:
#   100 ms), for the memory limit's pause, spill and restart; at 500 ms a runaway process is
#   caught at most 0.4 s later;
# - each server samples its machine's CPU, memory, disk and network for the dashboard's system
#   plots every system-monitor interval (Dask: 500 ms).
# The last two at dtrain's values: 48-62 -> 22-32 ms per second idle, and the chief's process 46-50
# -> 33 ms per second during async 1+2 training.
HOUSEKEEPING = {
    "distributed.admin.tick.interval": "500ms",
    "distributed.worker.memory.monitor-interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
}

DASK_ENV = {  # the worker processes' environment at their start (the nannies' pre-spawn-environ)
    # Dask sets MALLOC_TRIM_THRESHOLD_=65536 for nanny-spawned workers, which also turns off
    # glibc's dynamic mmap threshold: every activation and buffer over 128 KB is then mmapped and
    # unmapped each step (page faults: torch compute measured ~45% slower in such a worker).
    # Keep them on the heap instead (measured: per-step allocation halves speed).
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": str(MALLOC_TRIM_THRESHOLD),
    "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD),
    # Embedded workers share the terminal: only their warnings and errors (read at import).
    "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "warning",
}
