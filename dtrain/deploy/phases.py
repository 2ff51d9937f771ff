"""Where a run's fixed costs go: wall-clock marks of its phases (``dtrain run --profile-startup``).

``start`` (the CLI, from the process's own start time) turns the marks on; ``mark(name)`` then
records that the phase ``name`` ended now, and ``table`` gives each phase's duration and its end
since the start. Without ``start`` a mark costs one comparison, so the run's modules mark their
phases unconditionally: the CLI's import, validation, the pre-flight checks (the user's code, the
data, the plan), the embedded cluster's start, the workers' readiness, the ps actors and the
replicas' submission, the first step (the replicas' imports and data loading), the training, the
final evaluation and ``model.pt``, the summary, the cluster's shutdown, and the exit.
"""

from __future__ import annotations

import os
import time

_t0: float | None = None
_marks: list[tuple[str, float]] = []


def process_start() -> float:
    """When this process started (time.time()'s clock), or now if that cannot be read.

    On Linux from its start in clock ticks since boot and the uptime, both to 10 ms: psutil's
    ``create_time`` adds those ticks to the boot time in whole seconds (``btime``), up to a second
    off, which made a quick run's "last step to exit" come out negative."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil either
        return time.time()


def start(t0: float | None = None) -> None:
    """Record marks from now on, measured from ``t0`` (default: the process's start)."""
    global _t0
    _t0 = process_start() if t0 is None else t0
    _marks.clear()


def timing() -> bool:
    """Whether ``start`` turned the marks on."""
    return _t0 is not None


def mark(name: str) -> None:
    """The phase ``name`` ended now (a no-op unless ``start`` was called)."""
    if _t0 is not None:
        _marks.append((name, time.time()))


def mark_once(name: str) -> None:
    if _t0 is not None and all(n != name for n, _ in _marks):
        _marks.append((name, time.time()))


def table() -> list[tuple[str, float, float]]:
    """(phase, seconds it took, seconds since the start at its end), in order."""
    if _t0 is None:
        return []
    out, last = [], _t0
    for name, t in _marks:
        out.append((name, t - last, t - _t0))
        last = t
    return out


def format_table() -> str:
    rows = table()
    if not rows:
        return ""
    w = max(len(n) for n, _, _ in rows)
    lines = [f"{'phase':<{w}}  {'took s':>7}  {'at s':>7}"]
    lines += [f"{n:<{w}}  {d:>7.2f}  {a:>7.2f}" for n, d, a in rows]
    return "\n".join(lines)
