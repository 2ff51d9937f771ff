"""The run directory (docs/cli.md, "Run directory") and what a run returns.

Every file the chief writes there goes through :func:`atomic_write` (temp file, fsync, rename,
directory fsync): readers see the old file or the new one, never a torn one. Training runs
(``session``) and graph pipelines (``dtrain.graph.runner``) both write ``summary.json`` with
:func:`write_json` and return a :class:`Result`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import RunDirError
from dtrain.plan.compiler import Plan
from dtrain.spec.pipeline import PipelineSpec

from .files import atomic_write, fsync_dir  # noqa: F401 (fsync_dir: re-exported)

if TYPE_CHECKING:
    from dtrain.deploy.cluster import Connection

logger = logging.getLogger(__name__)


@dataclass
class Result:
    """What ``dtrain.run`` returns: the summary (as written to summary.json), the trained model
    (for a training pipeline), the fetched values (for a graph pipeline) and the run directory."""

    summary: dict[str, Any]
    model: Any = None  # torch.nn.Module for a training pipeline
    run_dir: Path | None = None
    fetched: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    replica_stats: list[dict[str, Any]] = field(default_factory=list)


def default_run_dir(spec: PipelineSpec) -> Path:
    return Path("runs") / spec.name


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A run directory holding checkpoints is never overwritten silently (exit 2 via RunDirError)."""
    if (run_dir / ".lock").exists():  # one in use says so first (a running run has checkpoints from step 0)
        with RunDirLock(run_dir):
            pass
    from .checkpoint import list_checkpoints

    ckpts = list_checkpoints(run_dir)
    if ckpts and not resume:
        raise RunDirError(f"{run_dir} already holds {len(ckpts)} checkpoint(s) (newest {ckpts[-1].name}); "
                          "pass --resume to continue from it, or choose another --run-dir")


def clean_json(value: Any) -> Any:
    """JSON data without NaN or infinities (null instead): strict JSON for jq and browsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Strict JSON (non-finite numbers written as null), atomically."""
    text = json.dumps(clean_json(obj), indent=2, default=str, allow_nan=False)
    atomic_write(path, (text + "\n").encode("utf-8"))


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` through :func:`atomic_write` (``model.pt``)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


class RunDirLock:
    """An exclusive lock on a run directory for the run's lifetime (``flock`` on ``RUN_DIR/.lock``,
    released by the kernel if the process dies): two runs never share one directory."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        import fcntl

        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(f"{self.run_dir} is in use by another run (pid {holder}); wait for it to end or "
                              "choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def remove_unused_run_dir(run_dir: Path) -> None:
    """Remove a run directory this run created and left empty but for its lock file (a run that
    never reached its cluster leaves nothing behind)."""
    run_dir = Path(run_dir)
    try:
        if {p.name for p in run_dir.iterdir()} <= {".lock"}:
            (run_dir / ".lock").unlink(missing_ok=True)
            run_dir.rmdir()
    except OSError:  # not empty after all, or already gone: leave it as it is
        pass


def early_summary(spec: PipelineSpec, status: str, error: str, wall_s: float) -> dict[str, Any]:
    """summary.json for a run that ended before its session could write one (the cluster did not
    start, its task workers never came): the contract's keys, nothing trained."""
    t = spec.training
    return {"name": spec.name, "status": status, "global_step": 0, "final_loss": None, "eval": None,
            "wall_s": round(wall_s, 3), "samples_per_sec": None, "mode": t.mode, "replication": t.replication,
            "replicas": spec.num_replicas() if not spec.is_graph else 0, "recoveries": 0, "dropped_stale": 0,
            "error": error}


def describe_exit(exc: BaseException) -> tuple[str, str]:
    """(status, error) of a run ended by ``exc``."""
    from dtrain.errors import RunError, Terminated

    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", (str(exc) or "terminated (SIGTERM)") if isinstance(exc, Terminated) else "interrupted"
    if isinstance(exc, RunError):
        return "failed", str(exc)
    return "failed", f"{type(exc).__name__}: {exc}"


def write_cluster_info(run_dir: Path, conn: Connection, generation: int, assignment: str, refresh: bool = True) -> None:
    """``cluster.json``: scheduler, dashboard, how tasks found their workers (``assign``: named or
    auto), and each task's worker address and process id (for operators, and for fault tests
    that kill a task's process by pid). Without ``refresh`` only new workers are asked their
    pid (elastic joins and leaves: a worker busy closing is not waited on)."""
    pids = conn.pids
    if refresh:  # a restarted worker may come back at the same address
        pids.clear()
    new = sorted(set(conn.tasks.values()) - set(pids))
    if new:
        try:
            # (callback_timeout is client.sync's: a frozen worker must not hang the chief)
            pids.update(conn.client.run(os.getpid, workers=new, callback_timeout=10))
        except Exception as exc:  # informational only
            logger.debug("could not read worker pids: %s", exc)
    workers = {task: {"address": addr, "pid": pids.get(addr)} for task, addr in sorted(conn.tasks.items())}
    scheduler = conn.client.scheduler
    assert scheduler is not None  # a connected client
    write_json(run_dir / "cluster.json", {
        "scheduler": scheduler.address, "dashboard": conn.dashboard_link,
        "generation": generation, "assign": assignment, "tasks": workers})
