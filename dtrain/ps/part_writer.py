"""One ps task's part of a checkpoint: written by the task itself, in the background.

A checkpoint (``dtrain.chief.checkpoint``) is one file per ps task plus a manifest the chief
writes once every part is durable. A task writes its part from a copy-on-write snapshot: at the
checkpoint's step, with applies held, it forks a writer process, which sees the task's memory as it
was at that instant, saves it with ``torch.save`` straight from those pages (no second copy of the
tables), hashes the file in chunks, fsyncs and renames it, reports ``{file, bytes, sha256}`` through
a pipe and exits. The task releases its hold as soon as the fork returns: training goes on while
the part is written, and only the pages training modifies meanwhile are copied (by the kernel).

Where forking is not safe (CUDA initialised in the process, or no ``os.fork``), the part is written
in the calling thread instead, while applies are held. One writer per task at a time: a second
``start`` while one writes is refused (the chief waits for the first, or skips the checkpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PART_FORMAT = 1


class BadPartError(ValueError):
    """A checkpoint part that is not what its manifest describes (size, checksum, content)."""


def part_name(shard: int) -> str:
    return f"shard-{shard:05d}.pt"


def digest(path: str | Path, chunk: int = 1 << 22) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks (memory: one chunk)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def save(obj: Any, target: str | Path | Any, directory: str | Path) -> None:
    """``torch.save(obj, target)`` into a file of ``directory``. On a full file system torch's writer
    reports only a short write ("unexpected pos ..."), the errno lost: that is raised as the
    ``OSError`` it was (ENOSPC, naming the directory) so that the run's error says the disk is full."""
    try:
        torch.save(obj, target)
    except RuntimeError as exc:
        cause = exc.__context__
        if isinstance(cause, OSError):  # (a file object's write raised it; torch went on to fail on its own)
            raise cause from None
        if _full(directory):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (writing into {directory})") from None
        raise


def _full(directory: str | Path) -> bool:
    """Whether the file system of ``directory`` has (next to) no free block for this process."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # (root may use the reserved blocks)
    return free * st.f_frsize < 1 << 16


def write_part_file(directory: str | Path, name: str, state: dict[str, Any],
                    meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save ``state`` as ``directory/name`` atomically (a temp file, fsynced, renamed, the directory
    fsynced); returns ``{"file", "bytes", "sha256", **meta}``, also written beside it
    (:func:`report_path`). ``torch.save`` to a path writes every tensor from its own memory: no
    serialised copy of the state is built."""
    directory = Path(directory)
    final = directory / name
    tmp = directory / f".{name}.tmp-{os.getpid()}"
    try:
        save({"part_format": PART_FORMAT, **state}, str(tmp), directory)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        size, sha = digest(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    out = {"file": name, "bytes": size, "sha256": sha, **(meta or {})}
    # Its outcome beside it (after the part is durable): the chief commits from these, even once the
    # task that wrote the part is gone.
    side = report_path(final)
    tmp_side = directory / f".{side.name}.tmp-{os.getpid()}"
    with open(tmp_side, "w") as f:
        json.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_side, side)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return out


def report_path(part: str | Path) -> Path:
    """Where a written part's ``{"file", "bytes", "sha256"}`` is kept beside it."""
    return Path(part).with_suffix(".json")


def written_report(part: str | Path) -> dict[str, Any] | None:
    """The report of a part written whole (:func:`write_part_file`), None while there is none."""
    try:
        return json.loads(report_path(part).read_text())
    except (OSError, ValueError):
        return None


def check_part_file(path: str | Path, nbytes: int, sha256: str) -> None:
    """BadPartError naming the file unless its size and sha256 are the manifest's (OSError when it
    cannot be read); the file is read in chunks."""
    path = Path(path)
    size = path.stat().st_size
    if size != nbytes:
        raise BadPartError(f"{path}: {size} bytes, the manifest says {nbytes} (truncated?)")
    if digest(path)[1] != sha256:
        raise BadPartError(f"{path}: sha256 mismatch (corrupt)")


def read_part_file(path: str | Path, nbytes: int, sha256: str, verify: bool = True) -> dict[str, Any]:
    """A part written by :func:`write_part_file`, once its size and checksum match the manifest's
    (:func:`check_part_file`; ``verify=False``: checked already, its size only), loaded with
    ``weights_only=True`` and memory-mapped (its tensors are read as they are copied out)."""
    path = Path(path)
    if verify:
        check_part_file(path, nbytes, sha256)
    elif path.stat().st_size != nbytes:
        raise BadPartError(f"{path}: {path.stat().st_size} bytes, the manifest says {nbytes} (truncated?)")
    try:
        state = torch.load(str(path), weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # torch raises several types for bad archives
        raise BadPartError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("part_format") != PART_FORMAT:
        raise BadPartError(f"{path}: not a checkpoint part of format {PART_FORMAT}")
    return state


def _built(state: dict[str, Any] | Callable[[], dict[str, Any]]) -> dict[str, Any]:
    return state() if callable(state) else state


def cloned(state: Any) -> Any:
    """A state dict's tensors copied (nested dicts and lists followed)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(cloned(v) for v in state)
    return state


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def drop_pages(t: torch.Tensor) -> None:
    """Give back the pages that reading ``t`` faulted in, ``t`` being a tensor of a part
    :func:`read_part_file` memory-mapped (never another: its memory would be lost): they are the
    file's, read again if touched. A restore then holds one chunk of its part at a time, not the
    whole part beside the task's own rows (Linux; elsewhere nothing is done)."""
    n = t.numel() * t.element_size()
    start = t.data_ptr()
    lo, hi = -(-start // _PAGE) * _PAGE, (start + n) // _PAGE * _PAGE
    if hi > lo:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


def _die_with_parent() -> None:
    """Linux: the writer gets SIGKILL when the task that forked it dies (no orphan writer goes on
    filling a checkpoint nobody will commit)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def can_fork() -> bool:
    """Whether a copy-on-write writer may be forked here: not once CUDA is initialised (a forked
    child cannot use it, and its driver state is not fork-safe)."""
    return hasattr(os, "fork") and not torch.cuda.is_initialized()


class PartWriter:
    """A task's checkpoint writer: :meth:`start` a part, :meth:`poll` until it is written."""

    def __init__(self, fork: bool | None = None, exit_wait_s: float = 10.0):
        """``exit_wait_s``: how long :meth:`start` waits for the previous writer to exit (its part
        is committed by then, from the report beside it: the writer is only closing its pipe)."""
        self.fork = can_fork() if fork is None else fork
        self.exit_wait_s = exit_wait_s
        self._child: tuple[int, int, int] | None = None  # (pid, read end of its pipe, step)
        self._done: dict[str, Any] | None = None
        self.started_at = 0.0

    @property
    def busy(self) -> bool:
        return self._child is not None

    def start(self, directory: str | Path, name: str, state: dict[str, Any] | Callable[[], dict[str, Any]],
              step: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``state`` (live tensors: call with applies held; or a function that builds it,
        called in the writer, where it sees the task's memory as it is now) as ``directory/name``;
        ``meta`` goes into the part's report. Returns ``{"started": step, "background": bool}``, or
        ``{"error": ...}`` when a part is still being written. Forked: returns at once; in-thread:
        once the part is written."""
        deadline = time.monotonic() + self.exit_wait_s
        while self._child is not None and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        if self._child is not None:
            return {"error": f"the part of step {self._child[2]} is still being written"}
        self._done = None
        self.started_at = time.monotonic()
        Path(directory).mkdir(parents=True, exist_ok=True)
        meta = dict(meta or {})
        if not self.fork:
            try:
                self._done = {"step": step, **write_part_file(directory, name, _built(state), meta)}
            except Exception as exc:
                self._done = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
            self._done["seconds"] = time.monotonic() - self.started_at
            return {"started": step, "background": False}
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (3.12+: fork with threads; see the module docstring)
            pid = os.fork()
        if pid == 0:  # the writer: only this thread exists here; it never returns into the task
            code = 1
            try:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (a signal to the process group is
                    signal.signal(sig, signal.SIG_IGN)  # the task's to answer: the part is written or dies with it)
                os.close(r)
                # Only its pipe: no lock, socket or file of the task's stays open in the writer (a run
                # directory's lock held by a writer of an in-process ps would outlive the run).
                os.closerange(3, w)
                os.closerange(w + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
                _die_with_parent()
                # One thread: the task's OpenMP pool did not survive the fork, and a parallel
                # torch op here (picking out a delta's rows) would wait on it forever.
                torch.set_num_threads(1)
                try:
                    out = {"step": step, **write_part_file(directory, name, _built(state), meta)}
                    code = 0
                except BaseException as exc:
                    out = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
                os.write(w, json.dumps(out).encode())
                os.close(w)
            finally:
                os._exit(code)
        os.close(w)
        self._child = (pid, r, step)
        return {"started": step, "background": True}

    def poll(self, wait: bool = False) -> dict[str, Any] | None:
        """The last part's outcome once written (``{"step", "file", "bytes", "sha256", "seconds"}``
        or ``{"step", "error"}``), None while it is being written (``wait``: block until it is)."""
        if self._child is None and self._done is None:
            return {"step": None, "error": "no checkpoint part was started on this task"}
        if self._child is not None:
            pid, r, step = self._child
            try:
                done, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its pipe says how it went
                done, status = pid, 0
            if not done:
                return None
            chunks = []
            while block := os.read(r, 1 << 16):
                chunks.append(block)
            os.close(r)
            self._child = None
            try:
                self._done = json.loads(b"".join(chunks).decode())
            except ValueError:
                how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exited {os.WEXITSTATUS(status)} without a report")
                self._done = {"step": step, "error": f"the checkpoint writer {how}"}
            self._done["seconds"] = time.monotonic() - self.started_at
        return self._done

    def close(self) -> None:
        """End a writer still running (the task is going away): its part is never committed."""
        if self._child is not None:
            pid, r, _ = self._child
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                os.close(r)
            self._child = None
