"""Shared-memory slots for a replica and a ps on the same machine (``training.shared_memory``).

Four buffers in one /dev/shm file: two gradient slots (the replica writes, the ps reads) and two
parameter slots (the ps writes a reply's snapshot, the replica computes on it). Only the request
and reply headers then cross the socket, which orders every access.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import re
import secrets

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^dtrain-[0-9a-f]{16,64}$")
_SHM_HEADER = 4096  # the token lives here; slots start page-aligned
F_SHM = 1  # request flag: the gradient and the reply travel through the shared slots


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
        self._mm = mm
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
        name = f"dtrain-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.nbytes(numel, dtype)
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
        self.grad = self.param = []
        try:
            self._mm.close()
        except BufferError:  # a model still views a slot: the mapping goes when the views do
            pass


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
