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

A chief that was killed (SIGKILL, the OOM killer) cannot remove the directory of the server's
socket (``/tmp/pymp-*``, removed by the chief's exit handlers otherwise): the server, ending after
it, removes it then.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal

from dtrain.deploy.preload import IGNORED

_SERVER, _CHIEF = os.getpid(), os.getppid()


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
