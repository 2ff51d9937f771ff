"""The pipeline file's errors, shared by the loader, the compiler and the CLI: ``Problem`` (one
problem, ``FILE:LINE: path: message``) and ``SpecError`` (an invalid pipeline, exit 2).

The runtime's errors (``RunError``, ``ConnectError``, ``Aborted``, ``Unavailable``, ``OutOfRange``,
...) live in :mod:`dtrain.errors`.
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


def _dotted(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


dotted = _dotted

