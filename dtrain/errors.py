"""The runtime's errors: a run that failed, a cluster that cannot be reached, the transient errors
the session recovers from, and the clean end of training (``OutOfRange``).

A leaf module (it imports nothing of dtrain), so that every plane may raise and catch them: the
data streams raise ``OutOfRange`` at the end of ``data.epochs``, a hook raises it to stop, the
chief and the CLI catch them. The pipeline file's own errors (``SpecError``, ``Problem``) live
in :mod:`dtrain.spec.errors`. The public ones are exported from :mod:`dtrain` (``dtrain.RunError``,
``dtrain.Aborted``, ``dtrain.OutOfRange``, ...).

Vocabulary (used everywhere in dtrain):

- *task*: one member of a job, ``/job:ps/task:0``; served by one Dask worker named ``ps-0``.
- *shard*: the variables one ps task holds, as one flat buffer.
- *replica*: one training loop, pinned to one worker task.
- *global step*: one update applied to the ps (counted on ps task 0).
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that failed after it started (missing tasks, a replica's error, recoveries used up).

    The CLI prints it and exits 1.
    """


class ConnectError(RunError):
    """The cluster could not be reached (no scheduler at the address, a refused TLS handshake, a
    scheduler file that cannot be read): the run never started, so nothing is written (exit 1)."""


class TransientError(RuntimeError):
    """An error the session recovers from, TensorFlow's "preemption errors" (AbortedError,
    UnavailableError): every shard restarts from the newest checkpoint (or from the initial
    parameters at step 0 when there is none) and every replica restarts, counted against
    ``training.max_recoveries``; once those are used up the run fails (RunError, exit 1). Any
    other error fails the run at once. dtrain raises it for a ps call that got no answer; a hook
    may raise :class:`Aborted` or :class:`Unavailable` itself."""


class Aborted(TransientError):
    """TF's AbortedError: an operation was aborted; the session recovers (:class:`TransientError`)."""


class Unavailable(TransientError):
    """TF's UnavailableError: a ps or worker did not answer; the session recovers (:class:`TransientError`)."""


class OutOfRange(Exception):  # noqa: N818 - TensorFlow's name (OutOfRangeError), as Aborted/Unavailable
    """TF's OutOfRangeError: the clean end of training. Raised by a hook (as is StopIteration), it
    ends training like ``ctx.request_stop()``: the final checkpoint, evaluation and model.pt are
    written, status completed. A replica's data stream raises it too, once the replica has read
    its data ``data.epochs`` times."""


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (it holds checkpoints and --resume was not given).

    The CLI prints it and exits 2: nothing was started and nothing written.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the session checkpoints and writes its summary
    before the CLI exits 143 (a KeyboardInterrupt subclass: every interrupt path handles it)."""
