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
"""

from __future__ import annotations

import signal

from dtrain.deploy.preload import IGNORED

for _sig in IGNORED:
    signal.signal(_sig, signal.SIG_IGN)
if hasattr(signal, "pthread_sigmask"):
    # The chief spawned this server with them blocked (forkserver._signals_held): one that came
    # while it started is discarded now, being ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)
