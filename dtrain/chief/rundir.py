"""The run directory (DESIGN.md's contract) and what a run returns.

Every file the chief writes there goes through :func:`atomic_write` (temp file, fsync, rename,
directory fsync): readers see the old file or the new one, never a torn one. Training runs
(``session``) and graph pipelines (``dtrain.graph.runner``) both write ``summary.json`` with
:func:`write_json` and return a :class:`Result`.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.spec.errors import RunDirError


@dataclass
class Result:
    """What ``dtrain.run`` returns: the summary (as written to summary.json), the trained model
    (for a training pipeline), the fetched values (for a graph pipeline) and the run directory."""

    summary: dict[str, Any]
    model: Any = None  # torch.nn.Module for a training pipeline
    run_dir: Path | None = None
    fetched: dict[str, Any] = field(default_factory=dict)
    plan: Any = None  # dtrain.plan.compiler.Plan
    replica_stats: list[dict[str, Any]] = field(default_factory=list)


def default_run_dir(spec: Any) -> Path:
    return Path("runs") / spec.name


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A run directory holding checkpoints is never overwritten silently (exit 2 via RunDirError)."""
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*.pt")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts and not resume:
        raise RunDirError(f"{run_dir} already holds {len(ckpts)} checkpoint(s) (newest {ckpts[-1].name}); "
                          "pass --resume to continue from it, or choose another --run-dir")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: readers see the old file or the new one, never a torn one (used
    for checkpoints, manifests, summary.json and model.pt)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, interrupt) leaves no temp file behind
        raise


def write_json(path: Path, obj: dict[str, Any]) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, default=str) + "\n").encode("utf-8"))


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` through :func:`atomic_write` (``model.pt``)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())
