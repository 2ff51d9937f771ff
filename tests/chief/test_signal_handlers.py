"""The chief's signal handlers in this process (no run): a signal whose exception Python drops,
because its handler ran inside a finaliser, still stops the run at the session's next poll.
(Signals to real runs: test_signals.py.)"""

from __future__ import annotations

import signal
import sys

import pytest

from dtrain.chief import signals
from dtrain.errors import Terminated


class SignalledInFinaliser:
    """Receives ``sig`` while its ``__del__`` runs: the handler's exception is raised there, where
    Python prints "Exception ignored in ..." and drops it."""

    def __init__(self, sig: int):
        self.sig = sig

    def __del__(self) -> None:
        signal.raise_signal(self.sig)
        self.after = True  # (a bytecode after the signal: its handler runs here)


@pytest.mark.parametrize(("sig", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_a_finaliser_dropped_is_raised_at_the_next_poll(sig, raised, monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    with signals.handled():
        signals.reraise_lost()  # nothing came: nothing raised
        obj = SignalledInFinaliser(sig)
        del obj  # the handler's exception is dropped here; without reraise_lost the run goes on
        assert dropped == [raised]
        with pytest.raises(raised):
            signals.reraise_lost()
        signals.reraise_lost()  # raised once: the run's cleanup never sees it again
    signals.reraise_lost()  # outside a run (dtrain.run from Python): never raises


def test_a_signal_of_an_earlier_run_is_not_raised_in_the_next_one():
    with signals.handled(), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # raised where it came (the run's own cleanup handles it)
    with signals.handled():
        signals.reraise_lost()  # a new run (dtrain.run twice in one process) starts clean


@pytest.mark.parametrize(("sig", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_during_a_held_block_is_raised_once_the_block_is_done(sig, raised):
    """``held`` (the start-up's imports: an exception raised inside torch's C++ bindings aborts the
    process). Fails if the signal's exception is raised inside the block, if it is dropped, or if
    the handlers are not ``handled``'s again after it (a later signal would be lost)."""
    reached = []
    with signals.handled():
        with pytest.raises(raised):
            with signals.held():
                signal.raise_signal(sig)
                reached.append("after the signal, inside the block")  # (its handler ran before this)
        assert reached
        assert signal.getsignal(sig) is signals._raise
        with signals.held():
            pass  # nothing came: nothing raised
        with pytest.raises(raised):
            signal.raise_signal(sig)
    with signals.held():  # outside a run's handlers (dtrain.run from Python): changes nothing
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
