"""Signals during a run (the chief's process; embedded workers ignore them, see
``dtrain.deploy.preload``).

- ``dtrain run`` (:func:`handled`): SIGINT raises KeyboardInterrupt (exit 130); SIGTERM and
  SIGHUP (a dropped SSH session) raise :class:`~dtrain.errors.Terminated` (exit 143). The
  session then writes a provisional ``summary.json``, checkpoints consistently and cleans up.
  While the command imports torch and the chief (:func:`held`), a signal waits for the import's end.
- During that cleanup (:func:`deferred`, used by the session and ``dtrain.run`` in the main
  thread, whoever installed the handlers) a further signal is counted and logged, not raised: a
  second Ctrl-C must not cut the interrupt checkpoint or the cluster's shutdown short. The
  :data:`FORCE`-th signal ends the process at once (the provisional summary is on disk by then),
  counting the one that began the cleanup and every one since, through all of the cleanup's
  steps (the session's checkpoint and summary, the cluster's shutdown).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dtrain.errors import Terminated

logger = logging.getLogger(__name__)

HANDLED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
FORCE = 3  # the third signal (the one that began the cleanup included) ends the process at once
EXIT_CODES: dict[int, int] = {signal.SIGINT: 130}  # SIGTERM and SIGHUP: 143 (the contract's code for a stop request)


def exit_code(signum: int) -> int:
    return EXIT_CODES.get(signum, 143)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_count = 0  # signals this run got: raised by handled()'s handler, then counted by deferred()'s
_raised: int | None = None  # the last signal handled()'s handler raised (reraise_lost())


def _exception(signum: int) -> BaseException:
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return Terminated(f"terminated ({signal.Signals(signum).name})")


def _raise(signum: int, frame: Any) -> None:
    global _count, _raised
    _count += 1
    _raised = signum
    raise _exception(signum)


def reraise_lost() -> None:
    """Raise again a signal's exception that never reached the run. Python runs a signal handler
    at its next bytecode, whatever runs then: an exception raised inside a ``__del__`` method, a
    weakref callback or a finaliser (which a large import or a cluster's start run often) is
    printed as "Exception ignored in ..." and dropped, and the run would go on as if the signal
    never came. The session calls this at every poll: the exception of a signal that did reach
    the run took it out of that loop for good (its cleanup runs under :func:`deferred`)."""
    global _raised
    if _raised is not None and _main_thread() and signal.getsignal(signal.SIGINT) is _raise:
        signum, _raised = _raised, None
        logger.warning("%s came while Python was running a finaliser, which dropped its exception: "
                       "stopping now", signal.Signals(signum).name)
        raise _exception(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raised as exceptions in the main thread for the duration."""
    global _count, _raised
    if not _main_thread():
        yield
        return
    _count, _raised = 0, None
    with _installed(_raise):
        yield


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Under :func:`handled`: signals recorded instead of raised for the duration, the first then
    raised as its exception once the block is done (main thread only). For the start-up's imports
    of C extensions: a KeyboardInterrupt raised midway through ``import torch`` crosses its C++
    bindings, which abort the process (SIGABRT, exit -6) instead of letting it exit 130."""
    if not _main_thread() or signal.getsignal(signal.SIGINT) is not _raise:
        yield
        return
    got: list[int] = []
    with _installed(lambda signum, frame: got.append(signum)):
        yield
    if got:
        _raise(got[0], None)


@contextlib.contextmanager
def _installed(handler: Any) -> Iterator[None]:
    """``handler`` for every handled signal for the duration, the previous handlers restored after."""
    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class _Counter:
    """Counts signals into the run's ``_count``: the cleanup's steps each install one, and a
    signal counted in one step still counts in the next."""

    def __call__(self, signum: int, frame: Any) -> None:
        global _count
        _count += 1
        name = signal.Signals(signum).name
        if _count >= FORCE:
            logger.error("%s again: exiting now, without finishing the cleanup", name)
            os._exit(exit_code(signum))
        logger.warning("%s during the cleanup: finishing the checkpoint, summary and shutdown first "
                       "(%d more to exit at once)", name, FORCE - _count)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Count signals instead of raising them for the duration (main thread only; nests)."""
    global _count
    if not _main_thread() or isinstance(signal.getsignal(signal.SIGINT), _Counter):
        yield  # not ours to handle, or an enclosing cleanup counts them already
        return
    if signal.getsignal(signal.SIGINT) is not _raise:  # dtrain.run without handled(): this cleanup's own count
        _count = 0
    with _installed(_Counter()):
        yield
