"""Byte sizes as Dask reads them (``cluster.memory_limit``), without importing Dask.

``parse_size`` accepts the forms ``dask.utils.parse_bytes`` accepts with a number and a unit —
``4GiB``, ``512MB``, ``1.5 GB``, ``100M``, ``1e6 kB``, ``2Gi`` — and gives the same number of
bytes (tests/spec/test_sizes.py compares them). The spec may not import Dask (validating a file
must stay cheap: tests/test_layering.py), hence this small copy of its unit table.

``memory_limit_bytes`` is what a worker's ``memory_limit`` may be: such a size, ``auto`` or ``0``.
A bare number other than 0 is refused: Dask reads ``0.5`` as half the machine's memory and
``100`` as 100 bytes, which is never what a pipeline means.
"""

from __future__ import annotations

import math
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
UNITS: dict[str, int] = {"": 1, "b": 1}
for _p, _n in _DECIMAL.items():  # kB, k
    UNITS[f"{_p}b"] = UNITS[_p] = _n
for _p, _n in _BINARY.items():  # KiB, Ki
    UNITS[f"{_p}ib"] = UNITS[f"{_p}i"] = _n

_SIZE = re.compile(r"^(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)?(?P<unit>[A-Za-z]*)$")
MIN_MEMORY_LIMIT = 64 * 2**20
FORMS = "a size such as 4GiB or 512MB (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), 'auto' or 0 (no limit)"


def parse_size(text: str) -> int:
    """``"4GiB"`` -> 4294967296, as ``dask.utils.parse_bytes``; ValueError for anything else
    (negative, non-finite or unknown units included)."""
    s = text.replace(" ", "")
    m = _SIZE.match(s)
    if not s or m is None:
        raise ValueError(f"{text!r} is not a size")
    unit = m.group("unit").lower()
    if unit not in UNITS:
        raise ValueError(f"{text!r}: unknown unit {m.group('unit')!r}")
    number = float(m.group("number") or 1)  # "GB" alone is 1 GB, as Dask reads it
    value = number * UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large")
    return int(value)


def memory_limit_bytes(text: str) -> int | None:
    """A worker's memory limit in bytes; None for ``auto`` (Dask's share of the machine) and ``0``
    (no limit). ValueError naming the accepted forms otherwise."""
    s = text.strip()
    if s.lower() == "auto":
        return None
    m = _SIZE.match(s.replace(" ", ""))
    if m is not None and m.group("number") and not m.group("unit"):
        if float(m.group("number")) == 0:
            return None
        raise ValueError(f"{text!r} has no unit: write {FORMS} (Dask reads a bare number <= 1 as a share of the "
                         "machine's memory and a larger one as bytes)")
    try:
        n = parse_size(s)
    except ValueError as exc:
        raise ValueError(f"{exc}; write {FORMS}") from None
    if n < MIN_MEMORY_LIMIT:
        raise ValueError(f"{text!r} is {n} bytes; a Dask worker running torch needs more: at least 64MiB "
                         "(4GiB is the default)")
    return n
