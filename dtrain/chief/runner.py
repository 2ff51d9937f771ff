"""``dtrain.run``: a pipeline on a cluster, from start to the run directory.

Everything a run can refuse (a run directory that holds checkpoints or is in use, a bad custom
hook) is refused before any cluster starts. Then it connects (the given client's cluster, a
running scheduler's, or an embedded one started and stopped here) and runs a graph pipeline
(``dtrain.graph.runner``) or a training :class:`~dtrain.chief.session.Session`, holding the run
directory's lock throughout, and writes ``summary.json`` on every exit once it has started.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distributed import Client

from dtrain.deploy import forkserver, phases
from dtrain.deploy.cluster import connect, dask_config
from dtrain.errors import ConnectError, RunDirError
from dtrain.spec.errors import Problem, SpecError
from dtrain.spec.pipeline import PipelineSpec, embedded_only_problems

from . import signals
from .inputs import file_input, sharded
from .preflight import check_before_start, collection_data
from .rundir import (
    Result,
    RunDirLock,
    check_run_dir,
    default_run_dir,
    describe_exit,
    early_summary,
    remove_unused_run_dir,
    write_json,
)
from .session import Session

logger = logging.getLogger(__name__)


def run(spec: PipelineSpec, client: Client | None = None, run_dir: str | Path | None = None, *,
        scheduler: str | None = None, resume: bool = False, progress: Callable[[dict[str, Any]], None] | None = None,
        processes: bool = True, data: Any = None) -> Result:
    """Run a pipeline. With ``client``, on that client's cluster (it must have a worker per task,
    named ``<job>-<index>`` or tagged with the resource ``<job>``); otherwise on
    ``scheduler``/``cluster.scheduler``, or on an embedded cluster started (and stopped) here.
    ``data``: a ``dask.dataframe.DataFrame`` (feature columns and ``data.target``) or an ``(X, y)``
    pair of ``dask.array``s to train on instead of ``data.source``; its partitions are the shards
    (docs/data.md)."""
    if client is not None or scheduler:
        # Keys of the embedded cluster do nothing on a cluster of the user's (cluster.scheduler is
        # checked by validation, --scheduler too when the pipeline was loaded with it).
        where = ("this run is on the cluster of the client given (client=)" if client is not None
                 else f"this run is on the scheduler at {scheduler}")
        if found := embedded_only_problems(spec, where=where):
            raise SpecError([Problem(message, path=".".join(map(str, loc))) for loc, message in found])
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(spec)
    check_run_dir(run_dir, resume)
    fresh = not run_dir.exists()
    try:
        return _run(spec, client, run_dir, scheduler, resume, progress, processes, data)
    except ConnectError:
        # The cluster was never reached: the run did not start, so it leaves nothing behind.
        if fresh:
            remove_unused_run_dir(run_dir)
        raise


def _run(spec: PipelineSpec, client: Client | None, run_dir: Path, scheduler: str | None, resume: bool,
         progress: Callable[[dict[str, Any]], None] | None, processes: bool, data: Any = None) -> Result:
    if spec.is_graph:
        from dtrain.graph.runner import run_graph

        with RunDirLock(run_dir):
            return run_graph(spec, client=client, scheduler=scheduler, processes=processes, run_dir=run_dir)
    # The user's code imported, the data loaded and checked against the model, the plan compiled:
    # a pipeline that cannot run is a SpecError here, before any cluster starts (preflight.py).
    embedded = client is None and scheduler is None and spec.cluster.scheduler is None
    if embedded and processes:  # the worker processes' parent imports torch while the checks below run
        forkserver.warm(spec, dask_config(spec))
    # The plan compiled here is the run's only compile: the session puts it on the workers (again
    # whenever they change), connecting waits for the tasks it uses.
    hooks, plan = check_before_start(spec, embedded=embedded, collection=data is not None)
    phases.mark("pre-flight: the user's code, the data, the plan")
    data_input = file_input(spec) if data is None and sharded(spec) else None  # cached by the preflight
    t0 = time.time()
    with RunDirLock(run_dir), contextlib.ExitStack() as stack:
        session: Session | None = None
        try:
            conn = stack.enter_context(connect(spec, client=client, scheduler=scheduler, processes=processes,
                                               plan=plan))
            if data is not None:  # a Dask collection: one pass on the cluster for its rows and statistics
                data_input = collection_data(spec, conn.client, data)
            session = Session(spec, conn, run_dir, resume=resume, progress=_first_step(progress), hooks=hooks,
                              data=data_input, plan=plan)
            # Actor handles find their client through the "current client" (this is not made the
            # process-wide default client, which belongs to the user).
            with conn.client.as_current():
                result = session.run()
            phases.mark("summary, hooks' end")
            return result
        except (SpecError, RunDirError, ConnectError):
            raise  # an invalid pipeline (exit 2) or a cluster never reached (exit 1): no summary
        except BaseException as exc:
            if session is None or not session.summary_written:
                status, error = describe_exit(exc)
                try:
                    write_json(run_dir / "summary.json", early_summary(spec, status, error, time.time() - t0))
                except OSError as write_exc:
                    logger.error("could not write %s: %s", run_dir / "summary.json", write_exc)
            raise
        finally:
            with signals.deferred():  # a second Ctrl-C must not cut the cluster's shutdown short
                stack.close()
            phases.mark("cluster shutdown")


def _first_step(progress: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """``progress``, marking the first step the chief sees when ``phases`` are timed (the
    replicas' start-up); as it was otherwise."""
    if not phases.timing():
        return progress

    def update(info: dict[str, Any]) -> None:
        if info.get("step"):
            phases.mark_once("first step (the replicas' imports, data, first pull)")
        if progress is not None:
            progress(info)
    return update
