"""Atomic checkpoints: each ps task writes its own part, the chief commits them with a manifest.

Layout under ``<run_dir>/checkpoints/``::

    ckpt-00000500/             one directory per checkpoint
        shard-00000.pt         a ps task's part, written by that task (ps/part_writer.py):
        shard-00001.pt         torch.save of {"params", "optimizer_state", "step", "tables", ...}
    ckpt-00000500.json         manifest, written by the chief once every part is durable:
                               {"format": 2, "step", "dir", "parts": [{"shard", "file", "bytes",
                               "sha256"}], "spec", "pipeline_hash", "time", "layout", "replicas"}
    invalid/                   checkpoints found corrupt, moved aside (never deleted)

With ``checkpoint.incremental``, a part may be a *delta* (``"kind": "delta", "base": <step>``
in the manifest): the dense state whole and, per table, only the rows written since the checkpoint
``base`` (ps/deltas.py). A part is then restored from its *chain*: the full part of the same shard
that starts it, then each delta in order (:func:`part_chain`). The manifest's ``depth`` is the
longest chain's number of deltas. A checkpoint whose chain is broken (a base missing or invalid)
is invalid; retention never deletes a checkpoint that a kept one's chain needs.

The manifest commits the checkpoint: a directory without one is a write that never finished and
does not exist (it is removed at the next save). A part is written to a temp file, fsynced and
renamed, its directory fsynced; the manifest the same way, then ``checkpoints/``. The newest
checkpoint whose manifest and parts agree (every part present with its size; the sha256 of each is
checked where the part is read: on its ps task when it restores, or here) is used to resume. A
newer one whose *content* is bad (a missing or truncated part, a checksum mismatch, unloadable) is
moved into ``invalid/`` with a warning; one that cannot be *read* (an I/O error: a file system
problem that may pass) stops the resume with an error naming it, and so does a directory holding
checkpoints none of which is valid: never a silent restart from step 0, and never a fall back past
a checkpoint that may be fine.

Checkpoints of format 1 (one file ``ckpt-<step>.pt`` written by the chief with the manifest
``{"step", "file", "bytes", "sha256", ...}``, as dtrain wrote them before the ps tasks wrote their
own parts) are still read, verified and restored; :func:`save` still writes one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.errors import RunError
from dtrain.ps.deltas import merge
from dtrain.ps.part_writer import digest, read_part_file
from dtrain.ps.part_writer import save as save_part

from .files import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

FORMAT = 1  # one file, written by the chief
PARTS_FORMAT = 2  # a directory of parts, one per ps task, and the chief's manifest
_NAME = re.compile(r"^ckpt-(\d{8,})(\.pt)?$")  # 8 digits, more past step 99,999,999; a file or a directory


class CheckpointError(RunError):
    """No checkpoint can be resumed from although some exist (or one cannot be read)."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its step, its path (the directory of parts, or a format-1 file) and
    its payload (``spec``, ``layout``, ``replicas``, ...; ``payload["shards"]``, every part loaded,
    is read on first use: a restore onto the same placement never reads it in the chief)."""

    step: int
    path: Path
    payload: dict[str, Any]

    @property
    def parts(self) -> list[dict[str, Any]] | None:
        """The manifest's parts (``shard``, ``file``, ``bytes``, ``sha256``), None for format 1."""
        return self.payload.get("parts") if self.payload.get("format") == PARTS_FORMAT else None


class _PartsPayload(dict):  # type: ignore[type-arg]
    """A format-2 manifest as a payload: ``["shards"]`` loads every part (verified) on first use."""

    def __init__(self, manifest: dict[str, Any], directory: Path):
        super().__init__(manifest)
        self._directory = directory

    def __missing__(self, key: str) -> Any:
        if key != "shards":
            raise KeyError(key)
        states = [read_part(self._directory, part) for part in sorted(self["parts"], key=lambda p: int(p["shard"]))]
        self["shards"] = states
        return states

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self or key == "shards" else default


def part_chain(directory: Path, part: dict[str, Any]) -> list[tuple[Path, int, str]]:
    """The files that hold ``part`` (a manifest's entry) of the checkpoint in ``directory``: (path,
    bytes, sha256) of the full part of its shard that starts its chain, then of each delta in
    order, the part itself last. ValueError when a base checkpoint or its part of the shard is
    missing, or the chain does not end in a full part."""
    try:
        return _chain(directory, part)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{directory.name}: a part in its manifest (or its base's) lacks {exc}") from None


def _chain(directory: Path, part: dict[str, Any]) -> list[tuple[Path, int, str]]:
    chain = [(directory / str(part["file"]), int(part["bytes"]), str(part["sha256"]))]
    seen = {directory.name}
    while part.get("kind") == "delta":
        base = directory.parent / f"ckpt-{int(part['base']):08d}"
        if base.name in seen:
            raise ValueError(f"{directory.name}: its chain of deltas loops at {base.name}")
        seen.add(base.name)
        manifest = _read_manifest(base)  # (ValueError: the base checkpoint is gone)
        shard = int(part["shard"])
        found = [p for p in manifest.get("parts") or () if int(p.get("shard", -1)) == shard]
        if not found:
            raise ValueError(f"{directory.name}: the checkpoint {base.name} its delta of shard {shard} follows "
                             "holds no part of that shard")
        directory, part = base, found[0]
        chain.insert(0, (directory / str(part["file"]), int(part["bytes"]), str(part["sha256"])))
    return chain


def read_part(directory: Path, part: dict[str, Any]) -> dict[str, Any]:
    """The state of ``part`` (a manifest's entry) of the checkpoint in ``directory``: its file, or
    the full part its chain starts with and each delta after merged over it (ps/deltas.py); every
    file verified as it is read (BadPartError)."""
    state: dict[str, Any] = {}
    for k, (path, nbytes, sha) in enumerate(part_chain(directory, part)):
        got = read_part_file(path, nbytes, sha)
        got.pop("part_format", None)
        state = got if k == 0 else merge(state, got)
    return state


def _bases(path: Path) -> set[str]:
    """The checkpoints (names) that the chains of ``path``'s parts need, itself excluded."""
    try:
        parts = _read_manifest(path).get("parts") or ()
    except (OSError, ValueError):
        return set()
    out: set[str] = set()
    for part in parts:
        if isinstance(part, dict) and part.get("kind") == "delta":
            try:
                out |= {p.parent.name for p, _, _ in part_chain(path, part)[:-1]}
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return out


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
    atomic_write(path, lambda f: save_part(payload, f, directory), sync_dir=False)
    size, sha = digest(path)
    manifest = {"step": int(step), "file": path.name, "bytes": size,
                "sha256": sha, "pipeline_hash": pipeline_hash, "time": now}
    atomic_write(path.with_suffix(".json"), (json.dumps(manifest, indent=2) + "\n").encode(), sync_dir=False)
    fsync_dir(directory)
    _retain(directory, path, keep, keep_every_n_hours)
    return path


def begin(run_dir: Path, step: int) -> Path | None:
    """The empty directory the ps tasks write the checkpoint of ``step`` into (a leftover of an
    unfinished write of the same step, never committed, is removed first); None when a checkpoint of
    that step is committed already (a resumed run that stops where it resumed: the same state)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)
    parts = directory / f"ckpt-{step:08d}"
    if parts.with_suffix(".json").exists():
        return None
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    fsync_dir(directory)
    return parts


def commit(parts_dir: Path, step: int, parts: list[dict[str, Any]], *, spec_data: dict[str, Any],
           pipeline_hash: str, replicas: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
           keep: int = 3, keep_every_n_hours: float | None = None) -> Path:
    """Commit the checkpoint whose ``parts`` (``shard``, ``file``, ``bytes``, ``sha256``: every ps
    task's, durable) are in ``parts_dir``: its manifest written atomically, then retention
    (:func:`to_delete`). Returns ``parts_dir``."""
    parts = sorted(parts, key=lambda p: int(p["shard"]))
    depth = max(len(part_chain(parts_dir, p)) - 1 for p in parts) if parts else 0
    manifest = {"format": PARTS_FORMAT, "step": int(step), "dir": parts_dir.name, "depth": depth,
                "parts": parts, "spec": spec_data,
                "pipeline_hash": pipeline_hash, "time": time.time(), "layout": layout or {},
                "replicas": replicas or {}}
    atomic_write(parts_dir.with_suffix(".json"), (json.dumps(manifest, indent=1) + "\n").encode(), sync_dir=False)
    fsync_dir(parts_dir.parent)
    _retain(parts_dir.parent, parts_dir, keep, keep_every_n_hours)
    return parts_dir


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint name (ckpt-<8-digit step>[.pt])")
    return int(m.group(1))


def _manifest_of(path: Path) -> Path:
    return path.with_suffix(".json")


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
    """Keep ``current`` (just committed) and the newest ``keep - 1`` older checkpoints (plus one per
    ``keep_every_n_hours``: :func:`to_delete`). Newer ones are left alone and not counted (a resume
    moved the invalid newer ones aside already). A deleted checkpoint loses its manifest first (it
    no longer exists), then its parts. Directories without a manifest (writes that never finished)
    and temp files of a writer killed mid-save go too."""
    step = _step_of(current)
    everything = list_checkpoints(directory.parent)
    older = [p for p in everything if _step_of(p) <= step]
    times = [_written_at(p) for p in older] if keep_every_n_hours else [0.0] * len(older)
    doomed = [older[i] for i in to_delete(times, keep, keep_every_n_hours)]
    needed = {name for p in everything if p not in doomed for name in _bases(p)}  # (the kept deltas' bases)
    for old in (p for p in doomed if p.name not in needed):
        _manifest_of(old).unlink(missing_ok=True)
        _remove(old)
    for p in directory.iterdir():
        if _NAME.match(p.name) and p.is_dir() and p != current and not _manifest_of(p).exists():
            _remove(p)
    # (the run directory's lock makes this run the only writer: another pid's temp files are stale)
    for p in directory.glob(".ckpt-*.tmp-*"):
        if f".tmp-{os.getpid()}-" not in p.name:
            p.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints by step, oldest first: the directories with a manifest, and format-1 files."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))
             and (m.group(2) or (p.is_dir() and _manifest_of(p).exists()))]
    return [p for _, p in sorted(found)]


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint against its manifest; returns its payload. A directory of parts: the
    manifest, and every part present with its size (the parts' checksums are checked where they are
    read: ``payload["shards"]``, or each ps task's ``load_part``). A format-1 file: its size and
    sha256, and it is loaded (``weights_only=True``).

    Raises ValueError saying what is wrong with its content (missing or foreign manifest, a missing
    part, size or checksum mismatch, unloadable, shards of a sync run at different steps) and
    OSError when it cannot be read at all.
    """
    if path.is_dir():
        return _verify_parts(path)
    manifest = _read_manifest(path)
    if manifest.get("file", path.name) != path.name:
        raise ValueError(f"{path.name}: manifest {_manifest_of(path).name} does not describe this file")
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


def _read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest (ValueError when it is missing or not a JSON object)."""
    manifest_path = _manifest_of(path)
    if not manifest_path.exists():
        raise ValueError(f"{path.name}: no manifest {manifest_path.name} (a save cut short?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path.name}: manifest {manifest_path.name} is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path.name}: manifest {manifest_path.name} does not describe this checkpoint")
    return manifest


def _verify_parts(path: Path) -> dict[str, Any]:
    manifest = _read_manifest(path)
    if manifest.get("dir") != path.name:
        raise ValueError(f"{path.name}: manifest {_manifest_of(path).name} does not describe this checkpoint")
    if manifest.get("format") != PARTS_FORMAT:
        raise ValueError(f"{path.name}: unknown checkpoint format {manifest.get('format')!r} (this dtrain reads "
                         f"{FORMAT} and {PARTS_FORMAT})")
    if manifest.get("step") != _step_of(path):
        raise ValueError(f"{path.name}: holds step {manifest.get('step')!r}, not the step its name says")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ValueError(f"{path.name}: no parts in its manifest")
    for part in parts:
        for f, nbytes, _ in part_chain(path, part):
            where = path.name if f.parent == path else f"{path.name} (its delta's base {f.parent.name})"
            if not f.is_file():
                raise ValueError(f"{where}: part {f.name} is missing")
            if f.stat().st_size != nbytes:
                raise ValueError(f"{where}: part {f.name} has {f.stat().st_size} bytes, the manifest says "
                                 f"{nbytes} (truncated?)")
    return _PartsPayload(manifest, path)


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
    manifest = _manifest_of(path)
    if manifest.exists():  # (first: a checkpoint without its manifest no longer exists)
        os.replace(manifest, target.with_suffix(".json") if path.suffix else target.with_name(target.name + ".json"))
    os.replace(path, target)
    fsync_dir(invalid)
    fsync_dir(path.parent)
    return target
