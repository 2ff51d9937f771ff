"""Imported first by the embedded cluster's forkserver (``dtrain.deploy.forkserver``) and by
nothing else: the server then ignores SIGTERM and SIGHUP, as the worker processes do
(``dtrain.deploy.preload``; it ignores SIGINT itself).

A signal to the run's process group (a terminal's hang-up, ``kill -TERM -PGID``, systemd's stop)
reaches the server too. Were it to die, multiprocessing in the chief would read every process
forked from it as exited (its exit status comes through the server), and the nannies would take
the live ps and replica workers for lost while the chief is writing its interrupt checkpoint. The
server still ends with the chief (its pipe from the chief closes), and ``dtrain`` ends it as it exits.
"""

from __future__ import annotations

import signal

for _sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
    if _sig is not None:
        signal.signal(_sig, signal.SIG_IGN)
