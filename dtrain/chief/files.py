"""Durable file writes: a file replaced whole (temp file, fsync, rename) and a directory synced.
Every file the chief writes into the run directory goes through them (``rundir.py``), the
checkpoints' manifests too (``checkpoint.py``); apart from both so that neither imports the other
for them."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | Callable[[BinaryIO], None], sync_dir: bool = True) -> None:
    """Temp file, fsync, rename (then the directory fsynced unless ``sync_dir`` is false, for a
    caller that syncs it once after several writes): readers see the old file or the new one,
    never a torn one (used for checkpoints, manifests, summary.json and model.pt). The temp file
    is created exclusively with a random name and never through a symbolic link. ``data``: the
    bytes, or a function that writes them into the open file (a large checkpoint is serialised
    straight to disk, never held whole in memory as bytes)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, interrupt) leaves no temp file behind
        raise
    if sync_dir:
        fsync_dir(path.parent)
