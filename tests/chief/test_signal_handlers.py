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
