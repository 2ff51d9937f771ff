"""Atomic checkpoints of every shard, with a manifest and a checksum.

Layout under ``<run_dir>/checkpoints/``::

    ckpt-00000500.pt     torch.save of {"format", "step", "shards": [...], "replicas": {...},
                         "spec": <the pipeline as JSON data>, "pipeline_hash", "time",
                         "layout": {"variables", "parts", "shard_numel"}}
    ckpt-00000500.json   manifest: {"step", "file", "bytes", "sha256", "pipeline_hash"}
    invalid/             checkpoints found corrupt, moved aside (never deleted)

A checkpoint is written to a temp file, fsynced and renamed, then its manifest the same way,
then the directory is fsynced: a crash leaves either the old set or the new one. The newest
checkpoint whose bytes match its manifest's sha256, that loads with ``weights_only=True`` and
whose shards agree on one step (sync) is used to resume. A newer one whose *content* is bad
(truncated, corrupt, unloadable) is moved into ``invalid/`` with a warning; one that cannot be
*read* (an I/O error: a file system problem that may pass) stops the resume with an error naming
it, and so does a directory holding checkpoints none of which is valid: never a silent restart
from step 0, and never a fall back past a checkpoint that may be fine.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.spec.errors import RunError

from .rundir import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")  # 8 digits, more past step 99,999,999


class CheckpointError(RunError):
    """No checkpoint can be resumed from although some exist (or one cannot be read)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    payload: dict[str, Any]


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, shards: list[dict[str, Any]], *, spec_data: dict[str, Any],
         pipeline_hash: str, replicas: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
         keep: int = 3, keep_every_n_hours: float | None = None) -> Path:
    """Write ``ckpt-<step>.pt`` and its manifest atomically; keep the newest ``keep`` (and, with
    ``keep_every_n_hours``, one older checkpoint per that many hours: :func:`to_delete`)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)
    now = time.time()
    payload = {"format": FORMAT, "step": int(step), "shards": shards, "replicas": replicas or {},
               "spec": spec_data, "pipeline_hash": pipeline_hash, "time": now, "layout": layout or {}}
    path = directory / f"ckpt-{step:08d}.pt"
    # Serialised straight into the file (no second copy of the shards' states as bytes in memory),
    # then hashed as written, chunk by chunk: the manifest, written last, commits the checkpoint.
    atomic_write(path, lambda f: torch.save(payload, f), sync_dir=False)
    size, digest = _digest(path)
    manifest = {"step": int(step), "file": path.name, "bytes": size,
                "sha256": digest, "pipeline_hash": pipeline_hash, "time": now}
    atomic_write(path.with_suffix(".json"), (json.dumps(manifest, indent=2) + "\n").encode(), sync_dir=False)
    fsync_dir(directory)
    _retain(directory, path, keep, keep_every_n_hours)
    return path


def _digest(path: Path, chunk: int = 1 << 22) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint name (ckpt-<8-digit step>.pt)")
    return int(m.group(1))


def to_delete(times: list[float], keep: int, keep_every_n_hours: float | None = None) -> list[int]:
    """Which checkpoints retention deletes (indices into ``times``, the checkpoints' write times,
    oldest first): all but the newest ``keep``, except, with ``keep_every_n_hours`` (TF's Saver
    ``keep_checkpoint_every_n_hours``), one per that many hours among the older ones: the oldest,
    then each written at least that long after the previous one kept.

    Pure and stateless: the same files give the same answer at every save and after a restart
    (TF's Saver anchors the first period at its own creation time instead, and holds it in memory).
    """
    older = range(max(len(times) - max(keep, 1), 0))
    if not keep_every_n_hours:
        return list(older)
    period, kept_at, doomed = keep_every_n_hours * 3600.0, None, []
    for i in older:
        if kept_at is None or times[i] >= kept_at + period:
            kept_at = times[i]
        else:
            doomed.append(i)
    return doomed


def _written_at(path: Path) -> float:
    """A checkpoint's write time: its manifest's ``time`` (the file's mtime for older manifests)."""
    try:
        return float(json.loads(path.with_suffix(".json").read_text())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return path.stat().st_mtime


def _retain(directory: Path, current: Path, keep: int, keep_every_n_hours: float | None = None) -> None:
    """Keep ``current`` (just written) and the newest ``keep - 1`` older checkpoints (plus one per
    ``keep_every_n_hours``: :func:`to_delete`). Newer ones are left alone and not counted (a resume
    moved the invalid newer ones aside already)."""
    step = _step_of(current)
    older = [p for p in list_checkpoints(directory.parent) if _step_of(p) <= step]
    times = [_written_at(p) for p in older] if keep_every_n_hours else [0.0] * len(older)
    for old in (older[i] for i in to_delete(times, keep, keep_every_n_hours)):
        for p in (old, old.with_suffix(".json")):
            p.unlink(missing_ok=True)
    # Temp files of a writer killed mid-save (the run directory's lock makes this run the only
    # writer: another pid's are stale).
    for p in directory.glob(".ckpt-*.tmp-*"):
        if f".tmp-{os.getpid()}-" not in p.name:
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

    Raises ValueError saying what is wrong with its content (missing or foreign manifest, size or
    checksum mismatch, unloadable, shards of a sync run at different steps) and OSError when it
    cannot be read at all.
    """
    manifest_path = path.with_suffix(".json")
    if not manifest_path.exists():
        raise ValueError(f"{path.name}: no manifest {manifest_path.name} (a save cut short?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path.name}: manifest {manifest_path.name} is not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("file", path.name) != path.name:
        raise ValueError(f"{path.name}: manifest {manifest_path.name} does not describe this file")
    size = path.stat().st_size  # before reading: a huge bogus file is refused without loading it
    if size != manifest.get("bytes"):
        raise ValueError(f"{path.name}: {size} bytes, manifest says {manifest.get('bytes')} (truncated?)")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        raise ValueError(f"{path.name}: sha256 mismatch (corrupt)")
    try:
        payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types for bad pickles
        raise ValueError(f"{path.name}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path.name}: unknown checkpoint format {got!r}")
    if payload.get("step") != _step_of(path):
        raise ValueError(f"{path.name}: holds step {payload.get('step')!r}, not the step its name says")
    if not isinstance(payload.get("shards"), list) or not payload["shards"]:
        raise ValueError(f"{path.name}: no shard list")
    mode = ((payload.get("spec") or {}).get("training") or {}).get("mode")
    steps = sorted({int(sh.get("step", -1)) for sh in payload["shards"]})
    if mode == "sync" and len(steps) != 1:
        raise ValueError(f"{path.name}: a sync checkpoint whose shards are at different steps {steps} "
                         "(inconsistent; written by an interrupted save of an older dtrain)")
    return payload


def latest(run_dir: Path) -> Checkpoint | None:
    """The checkpoint to resume or recover from: the newest valid one, or None when the run
    directory holds no checkpoint at all.

    Newer checkpoints whose content is invalid are moved into ``checkpoints/invalid/`` with a
    warning. Raises :class:`CheckpointError` when one cannot be read (an I/O error) or when none
    of the checkpoints present is valid, naming each file and why.
    """
    problems: list[str] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            payload = verify(path)
        except OSError as exc:
            raise CheckpointError(
                f"cannot read checkpoint {path}: {exc}; fix the file system (or move the file aside) and "
                "resume again: a resume never skips a checkpoint it could not read") from None
        except ValueError as exc:
            moved = quarantine(path)
            logger.warning("checkpoint %s is invalid (%s); moved it to %s and trying the previous one",
                           path.name, exc, moved.parent)
            problems.append(str(exc))
            continue
        return Checkpoint(int(payload["step"]), path, payload)
    if problems:
        raise CheckpointError(f"no valid checkpoint in {checkpoint_dir(run_dir)} ("
                              + "; ".join(problems) + "): moved to checkpoints/invalid/; to start over, "
                              "use another --run-dir")
    return None


def quarantine(path: Path) -> Path:
    """Move a checkpoint and its manifest into ``checkpoints/invalid/`` (never delete it); returns
    the new path of the checkpoint."""
    invalid = path.parent / "invalid"
    invalid.mkdir(exist_ok=True)
    target = invalid / path.name
    n = 1
    while target.exists():
        target = invalid / f"{path.stem}.{n}{path.suffix}"
        n += 1
    os.replace(path, target)
    manifest = path.with_suffix(".json")
    if manifest.exists():
        os.replace(manifest, target.with_suffix(".json"))
    fsync_dir(invalid)
    fsync_dir(path.parent)
    return target
