"""Shared memory for a replica and a ps on the same machine (``training.shared_memory``).

- ``SharedSlots``: four buffers in one /dev/shm file that the replica creates: two gradient slots
  (the replica writes, the ps reads) and two parameter slots (the ps writes a reply's snapshot, the
  replica computes on it). Only the request and reply headers then cross the socket, which orders
  every access.
- ``SharedParams``: the ps's own parameters in an anonymous memory file (memfd) that replicas on
  its machine map read-only, for sync replication without backup replicas: every replica has
  pushed its gradient of step t before step t+1 is applied, so nobody reads while the ps writes,
  and a reply needs no snapshot at all (docs/performance.md, "Sync replicas read the ps's parameters in place").
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import re
import secrets
import time
import warnings

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^dtrain-[0-9a-f]{16,64}$")
_SHM_HEADER = 4096  # the token lives here; slots start page-aligned
F_SHM = 1  # request flag: the gradient and the reply travel through the shared slots
MIN_FREE = 0.10  # an offer must leave this fraction of /dev/shm free (DataLoader, NCCL, other users)
STALE_S = 300.0  # a dead creator's file older than this is swept
_swept = False


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


class SharedSlots:
    """Four buffers in one shared-memory file that a replica and a ps on the same machine both map:
    two gradient slots (the replica writes, the ps reads) and two parameter slots (the ps writes a
    reply's snapshot, the replica computes on it). Only the small headers then cross the socket,
    which orders every access (a request is sent after its slot is written, a reply after its
    slot is). The file is unlinked as soon as both sides have mapped it: nothing is left in
    /dev/shm even when a process is killed."""

    def __init__(self, mm: mmap.mmap, numel: int, dtype: torch.dtype):
        itemsize = torch.empty((), dtype=dtype).element_size()
        n, stride = numel * itemsize, _align(numel * itemsize)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        slots = [base[_SHM_HEADER + i * stride:_SHM_HEADER + i * stride + n].view(dtype) for i in range(4)]
        self.grad, self.param = slots[:2], slots[2:]

    @staticmethod
    def nbytes(numel: int, dtype: torch.dtype) -> int:
        return _SHM_HEADER + 4 * _align(numel * torch.empty((), dtype=dtype).element_size())

    @classmethod
    def create(cls, numel: int, dtype: torch.dtype) -> tuple[SharedSlots, str, bytes] | None:
        """The replica's side: a new file, its blocks allocated up front (a full /dev/shm fails
        here, and the connection falls back to the socket, instead of a SIGBUS mid-training)."""
        if not os.path.isdir(SHM_DIR):
            return None
        global _swept
        if not _swept:
            _swept = True
            sweep_stale()
        # The creator's pid leads the name, so a sweeper can tell a dead creator's leftovers.
        name = f"dtrain-{os.getpid():08x}{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.nbytes(numel, dtype)
        if not has_headroom(size):
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            logger.info("shared memory unavailable (%s): the data plane uses the socket", exc)
            unlink(path)
            return None
        finally:
            os.close(fd)
        token = secrets.token_bytes(16)
        mm[:16] = token
        return cls(mm, numel, dtype), name, token

    @classmethod
    def attach(cls, name: str, token: bytes, numel: int, dtype: torch.dtype) -> SharedSlots | None:
        """The ps's side: map the replica's file if it is one of ours, of the expected size, with
        the token the replica sent over the socket (else: None, and the socket carries the bytes)."""
        if not SHM_NAME.match(name):
            return None
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None  # another machine, or another /dev/shm (a container): not shared
        try:
            st = os.fstat(fd)
            size = cls.nbytes(numel, dtype)
            if st.st_size != size or st.st_uid != os.getuid():
                return None
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
            unlink(path)
        if not hmac.compare_digest(bytes(mm[:16]), token):
            mm.close()
            return None
        return cls(mm, numel, dtype)

    def close(self) -> None:
        """Drop this side's views. The mapping is never closed here: tensors made by
        ``torch.frombuffer`` hold the ``mmap`` object but not an export of it, so ``mmap.close``
        would unmap memory that a model's parameters or gradients still view (a crash on their
        next use); the file goes when the last of those views does (they keep the object)."""
        self.grad = self.param = []


class SharedParams:
    """The ps's parameters of one shard in an anonymous memory file (``memfd_create``: no name in
    /dev/shm, gone with the last process that maps it). The ps maps it read-write and makes it the
    shard's ``param``; a replica on the same machine opens ``/proc/<ps pid>/fd/<fd>`` read-only
    (the same user's process: the kernel's ptrace read check) and checks the token the ps sent
    over the authenticated socket, then computes on the ps's parameters in place. A replica that
    cannot open or map it (another machine, another pid namespace, ``hidepid``) says so in the
    handshake, and gets snapshots in its own slots."""

    def __init__(self, mm: mmap.mmap, numel: int, fd: int = -1, token: bytes = b""):
        self._mm = mm
        self.fd, self.token = fd, token
        with warnings.catch_warnings():  # a read-only mapping: torch warns it cannot mark the tensor so
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(mm, dtype=torch.uint8)
        self.tensor = base[_SHM_HEADER:_SHM_HEADER + numel * 4].view(torch.float32)

    @staticmethod
    def nbytes(numel: int) -> int:
        return _SHM_HEADER + _align(numel * 4)

    @classmethod
    def create(cls, numel: int) -> SharedParams | None:
        """The ps's side: a new memfd of the shard's size, its pages reserved up front (None where
        the platform has no memfd or /proc, or memory is short: replies then copy as before)."""
        if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
            return None
        try:
            fd = os.memfd_create("dtrain-params", getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            return None
        size = cls.nbytes(numel)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            logger.info("shared parameters unavailable (%s): sync replies copy a snapshot", exc)
            os.close(fd)
            return None
        token = secrets.token_bytes(16)
        mm[:16] = token
        mm[16:24] = numel.to_bytes(8, "little")  # checked by attach: the size alone is page-rounded
        return cls(mm, numel, fd, token)

    @classmethod
    def attach(cls, pid: int, fd: int, token: bytes, numel: int) -> SharedParams | None:
        """The replica's side: map the ps's file read-only, if it is the one the ps named (its token
        and the shard's float count); else None."""
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(f).st_size != cls.nbytes(numel):
                return None
            mm = mmap.mmap(f, cls.nbytes(numel), prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(f)
        if not hmac.compare_digest(bytes(mm[:16]), token) or int.from_bytes(mm[16:24], "little") != numel:
            mm.close()
            return None
        return cls(mm, numel)

    def close(self) -> None:
        """Close the file (the ps's side: no replica can attach any more). The mapping is never closed
        here: tensors made by ``torch.frombuffer`` do not pin it (``mmap.close`` would unmap
        memory that the shard's ``param`` or a replica's model still views); it goes when the
        last of them does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def has_headroom(size: int) -> bool:
    """Whether ``size`` more bytes leave MIN_FREE of /dev/shm free: the slots are reserved up
    front, and a full /dev/shm breaks other users of it on the machine."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free - size < MIN_FREE * total:
        logger.info("shared memory: %d MB more would leave less than %d%% of %s free (%d of %d MB): "
                    "the data plane uses the socket", size >> 20, MIN_FREE * 100, SHM_DIR, free >> 20, total >> 20)
        return False
    return True


def sweep_stale(min_age_s: float = STALE_S) -> list[str]:
    """Unlink this user's ``dtrain-*`` files whose creator is dead and that are older than
    ``min_age_s`` (a replica killed between creating its file and the handshake's end leaves
    one). Harmless even if wrong: a file is needed only until the ps has mapped it."""
    removed: list[str] = []
    now, uid = time.time(), os.getuid()
    try:
        names = [n for n in os.listdir(SHM_DIR) if SHM_NAME.match(n) and len(n) == 7 + 8 + 32]
    except OSError:
        return removed
    for n in names:
        path = os.path.join(SHM_DIR, n)
        try:
            st = os.stat(path, follow_symlinks=False)
            if st.st_uid != uid or now - st.st_mtime < min_age_s:
                continue
            os.kill(int(n[7:15], 16), 0)
            continue  # its creator lives
        except ProcessLookupError:
            unlink(path)
            removed.append(n)
        except OSError:  # gone meanwhile, or a pid we may not signal (alive)
            continue
    if removed:
        logger.info("shared memory: swept %d stale file(s) of dead processes from %s", len(removed), SHM_DIR)
    return removed
