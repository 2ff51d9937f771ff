"""Imported first by the embedded cluster's forkserver (``dtrain.deploy.forkserver``) and by
nothing else: the server then ignores SIGINT, SIGTERM and SIGHUP, as the worker processes do
(``dtrain.deploy.preload``). multiprocessing's server ignores SIGINT itself, but only once it has
imported its preload list (torch and dtrain: seconds on a loaded machine), and the interpreter's
own start comes before any of it: the chief spawns the server with these signals blocked
(``forkserver._signals_held``), and this module ignores and then unblocks them.

A signal to the run's process group (a terminal's hang-up, ``kill -TERM -PGID``, systemd's stop)
reaches the server too. Were it to die, multiprocessing in the chief would read every process
forked from it as exited (its exit status comes through the server), and the nannies would take
the live ps and replica workers for lost while the chief is writing its interrupt checkpoint. The
server still ends with the chief (its pipe from the chief closes), and ``dtrain`` ends it as it exits.

The server is multiprocessing's one forkserver for the whole process: a program that calls
``dtrain.run`` and later starts processes of its own with the forkserver context (Linux's default
from Python 3.14; DataLoader workers) gets them from this server. So each process forked from it
keeps these signals ignored only when it is a worker of dtrain's embedded cluster (its nanny's
worker arguments name dtrain's worker preload, ``dtrain.deploy.preload``); any other gets Python's
defaults back before its target runs, and ``Process.terminate()`` ends it as usual.

A chief that was killed (SIGKILL, the OOM killer) cannot remove the directory of the server's
socket (``/tmp/pymp-*``, removed by the chief's exit handlers otherwise): the server, ending after
it, removes it then.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import shutil
import signal
from multiprocessing import util
from typing import Any

from dtrain.deploy.preload import IGNORED

_SERVER, _CHIEF = os.getpid(), os.getppid()
WORKER_PRELOAD = "dtrain.deploy.preload"  # (deploy/cluster.py gives it to the embedded cluster's workers)
worker: bool | None = None  # in a process forked from the server: whether it is one of dtrain's workers


def _names_worker_preload(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` (a nanny's process target: partials of its worker arguments) names dtrain's
    worker preload. The nanny's arguments are Dask's internals: should they change shape, a worker
    is taken for a user's process and ignores the signals from its preload on (the chief's signal
    test covers the whole path)."""
    if isinstance(obj, str):
        return obj == WORKER_PRELOAD
    if depth > 3:
        return False
    if isinstance(obj, functools.partial):
        return any(_names_worker_preload(v, depth + 1) for v in (*obj.args, *obj.keywords.values()))
    if isinstance(obj, (list, tuple)):
        return any(isinstance(v, str) and v == WORKER_PRELOAD for v in obj)
    return False


def _after_fork(_anchor: object) -> None:
    """In each process forked from the server, once its process object is known (before its target
    runs): a process that is not one of dtrain's workers gets the default signal handling back."""
    global worker
    worker = any(_names_worker_preload(a) for a in getattr(multiprocessing.current_process(), "_args", ()))
    if not worker:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in IGNORED:
            if sig != signal.SIGINT:
                signal.signal(sig, signal.SIG_DFL)


class _Anchor:  # multiprocessing keeps after-fork callbacks by a weak reference to an object
    pass


_ANCHOR = _Anchor()
util.register_after_fork(_ANCHOR, _after_fork)


def _remove_orphaned_directory() -> None:
    """At the server's exit (not a forked worker's), when its chief is gone: its socket's directory."""
    if os.getpid() != _SERVER or os.getppid() == _CHIEF:
        return
    from multiprocessing import forkserver

    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


atexit.register(_remove_orphaned_directory)

for _sig in IGNORED:
    signal.signal(_sig, signal.SIG_IGN)
if hasattr(signal, "pthread_sigmask"):
    # The chief spawned this server with them blocked (forkserver._signals_held): one that came
    # while it started is discarded now, being ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)
