"""`dask worker` with dtrain's Dask settings: what `dtrain worker` execs.

The settings must be in the Dask config of the process that creates the nanny, before it spawns
the worker process: glibc reads ``MALLOC_*`` when a process starts (see
``dtrain.deploy.cluster.dask_config``), and environment variables cannot carry these upper-case keys
into Dask's config.
"""

from __future__ import annotations

import dask


def main() -> None:
    from .env import HOUSEKEEPING, MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD

    dask.config.set({
        "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": str(MALLOC_TRIM_THRESHOLD),
        "distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD),
        **HOUSEKEEPING,
    })
    from distributed.cli.dask_worker import main as dask_worker_main

    dask_worker_main()


if __name__ == "__main__":
    main()
