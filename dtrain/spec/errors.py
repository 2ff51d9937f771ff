"""Error types shared by the loader, the compiler, the CLI and the runtime.

Vocabulary (used everywhere in dtrain):

- *task*: one member of a job, ``/job:ps/task:0``; served by one Dask worker named ``ps-0``.
- *shard*: the variables one ps task holds, as one flat buffer.
- *replica*: one training loop, pinned to one worker task.
- *global step*: one update applied to the ps (counted on ps task 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One problem in a pipeline file: where (file, 1-based line, dotted path) and what.

    ``column`` (1-based, when known) only orders problems that share a line.
    """

    message: str
    path: str = ""
    file: str | None = None
    line: int | None = None
    column: int | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        where = f"{self.file or '<spec>'}:{self.line or 1}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ValueError):
    """An invalid pipeline: one or more problems, each printable as ``FILE:LINE: path: message``.

    The CLI prints ``str(error)`` (one line per problem) and exits 2.
    """

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class CrossFieldErrors(ValueError):
    """Raised inside a pydantic ``model_validator``: several problems, each with a path relative to
    the model that raised it. The loader expands it into one line per problem."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]):
        self.problems = problems
        super().__init__("; ".join(f"{_dotted(loc)}: {msg}" if loc else msg for loc, msg in problems))


class RunError(RuntimeError):
    """A run that failed after it started (missing tasks, a replica's error, recoveries used up).

    The CLI prints it and exits 1.
    """


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
    """TF's OutOfRangeError, for hooks: raised by a hook (as is StopIteration), it ends training
    cleanly, like ``ctx.request_stop()``: the final checkpoint, evaluation and model.pt are written,
    status completed. (A replica at the end of ``data.epochs`` has its own, data.stream.OutOfRange.)"""


class ConnectError(RunError):
    """The cluster could not be reached (no scheduler at the address, a refused TLS handshake, a
    scheduler file that cannot be read): the run never started, so nothing is written (exit 1)."""


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (it holds checkpoints and --resume was not given).

    The CLI prints it and exits 2: nothing was started and nothing written.
    """


def _dotted(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


dotted = _dotted


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the session checkpoints and writes its summary
    before the CLI exits 143 (a KeyboardInterrupt subclass: every interrupt path handles it)."""
