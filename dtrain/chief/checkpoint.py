"""Atomic checkpoints of every shard, with a manifest and a checksum.

Layout under ``<run_dir>/checkpoints/``::

    ckpt-00000500.pt     torch.save of {"format", "step", "shards": [...], "replicas": {...},
                         "spec": <the pipeline as JSON data>, "pipeline_hash", "time"}
    ckpt-00000500.json   manifest: {"step", "file", "bytes", "sha256", "pipeline_hash"}

A checkpoint is written to a temp file, fsynced and renamed, then its manifest the same way,
then the directory is fsynced: a crash leaves either the old set or the new one. The newest
checkpoint whose bytes match its manifest's sha256 and that loads with ``weights_only=True``
is used to resume; a corrupt or truncated newest one is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .rundir import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")  # 8 digits, more past step 99,999,999


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    payload: dict[str, Any]


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, shards: list[dict[str, Any]], *, spec_data: dict[str, Any],
         pipeline_hash: str, replicas: dict[str, Any] | None = None, keep: int = 3) -> Path:
    """Write ``ckpt-<step>.pt`` and its manifest atomically; keep the newest ``keep``."""
    import io

    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "step": int(step), "shards": shards, "replicas": replicas or {},
               "spec": spec_data, "pipeline_hash": pipeline_hash, "time": time.time()}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    path = directory / f"ckpt-{step:08d}.pt"
    atomic_write(path, data)
    manifest = {"step": int(step), "file": path.name, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "pipeline_hash": pipeline_hash}
    atomic_write(path.with_suffix(".json"), (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(directory)
    _retain(directory, path, keep)
    return path


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint name (ckpt-<8-digit step>.pt)")
    return int(m.group(1))


def _retain(directory: Path, current: Path, keep: int) -> None:
    """Keep ``current`` (just written) and the newest ``keep - 1`` older checkpoints.

    A checkpoint *newer* than ``current`` exists only when this run resumed or recovered past it,
    i.e. it failed :func:`verify`: it is removed (with a warning) rather than counted against
    ``keep`` (with keep: 1 the checkpoint just written would otherwise be deleted) or left to be
    tried first at every later resume. A newer one that does verify is left alone and not counted.
    """
    step = _step_of(current)
    paths = list_checkpoints(directory.parent)
    doomed = []
    for p in (p for p in paths if _step_of(p) > step):
        try:
            verify(p)
        except (OSError, ValueError) as exc:
            logger.warning("removing %s, newer than the checkpoint just written (%s) but invalid: %s",
                           p.name, current.name, exc)
            doomed.append(p)
    older = [p for p in paths if _step_of(p) <= step]
    doomed += older[:max(len(older) - max(keep, 1), 0)]
    for old in doomed:
        for p in (old, old.with_suffix(".json")):
            p.unlink(missing_ok=True)
    # Temp files of a writer killed mid-save (the chief is the only writer: another pid's are stale).
    for p in directory.glob(".ckpt-*.tmp-*"):
        if not p.name.endswith(f".tmp-{os.getpid()}"):
            p.unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files by step, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest and load it (``weights_only=True``).

    Raises ValueError saying what is wrong (missing manifest, size or checksum mismatch, unloadable).
    """
    manifest_path = path.with_suffix(".json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.name}: manifest {manifest_path.name} unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("file", path.name) != path.name:
        raise ValueError(f"{path.name}: manifest {manifest_path.name} does not describe this file")
    # The size first, from stat: a huge bogus file is refused without being read into memory.
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        raise ValueError(f"{path.name}: {size} bytes, manifest says {manifest.get('bytes')} (truncated?)")
    data = path.read_bytes()
    if len(data) != size:
        raise ValueError(f"{path.name}: changed while being read ({len(data)} bytes, {size} before)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest.get("sha256"):
        raise ValueError(f"{path.name}: sha256 mismatch (corrupt)")
    import io

    try:
        payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types for bad pickles
        raise ValueError(f"{path.name}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path.name}: unknown checkpoint format {got!r}")
    if payload.get("step") != _step_of(path):
        raise ValueError(f"{path.name}: holds step {payload.get('step')!r}, not the step its name says")
    if not isinstance(payload.get("shards"), list):
        raise ValueError(f"{path.name}: no shard list")
    return payload


def latest(run_dir: Path) -> Checkpoint | None:
    """The newest valid checkpoint (skipping, with a warning, any newer one that fails :func:`verify`)."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            payload = verify(path)
        except (OSError, ValueError) as exc:
            logger.warning("skipping checkpoint %s: %s; trying the previous one", path, exc)
            continue
        return Checkpoint(int(payload["step"]), path, payload)
    return None
