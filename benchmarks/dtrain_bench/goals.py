"""Issue 16's goals on one machine, judged from a run's summaries (printed, never asserted).

The ratio goals hold for the benchmark MLP with default settings; the ps's CPU goal is per push
(one applied gradient: the unit of its floor, an SGD apply plus one snapshot of the shard), judged
on the highest of the rows measured; the fixed cost per step is the tiny model's (``--tiny``).
A goal whose row was not run, or failed, has no value. A run that changes the settings (``--set``,
another ``--optimizer``) prints them for reference only (``applies`` false). The link goals are
in link.py.
"""

from __future__ import annotations

from typing import Any

from .configs import FIXED_COST_GOAL_MS, GOALS, PS_PUSH_GOAL_MS
from .report import fmt_num

LABELS = {"async_1ps_1w": "async 1+1", "async_1ps_2w": "async 1+2", "sync_1ps_2w": "sync 1+2",
          "ingraph_1ps_2w": "in-graph 1+2"}


def one_machine(results: dict[str, dict[str, Any]], tiny: bool, changed: list[str] | None = None
                ) -> list[dict[str, Any]]:
    """The goals with their values: ``goal``, ``value``, ``target``, ``at_most`` (a ceiling, not a
    floor), ``met`` (None without a value), ``note`` and ``applies`` (false when ``changed``
    names settings the run changed from the defaults)."""
    rows: list[tuple[str, float | None, float, bool, str]] = []
    if tiny:
        fixed = (results.get("async_1ps_1w") or {}).get("fixed_cost_ms")
        rows.append(("fixed cost per step, async 1+1 (ms)", fixed, FIXED_COST_GOAL_MS, True, "tiny model"))
    else:
        for name, target in GOALS.items():
            rows.append((f"{LABELS[name]} (defaults) / plain", (results.get(name) or {}).get("ratio"), target,
                         False, ""))
        per_push = [((r.get("cpu_ms_per_replica_step") or {}).get("ps_per_push"), name)
                    for name, r in results.items() if name in GOALS]
        worst = max(((v, n) for v, n in per_push if v is not None), default=(None, None))
        rows.append(("ps CPU per push, highest row (ms)", worst[0], PS_PUSH_GOAL_MS, True,
                     LABELS[worst[1]] if worst[1] else ""))
    return [{"goal": goal, "value": value, "target": target, "at_most": at_most, "note": note,
             "met": None if value is None else (value <= target if at_most else value >= target),
             "applies": not changed}
            for goal, value, target, at_most, note in rows]


def print_goals(goals: list[dict[str, Any]], changed: list[str] | None = None) -> None:
    print()
    print("issue 16's goals on one machine (default settings; nothing is asserted):")
    if changed:
        print(f"  for reference only: this run changed {', '.join(changed)}")
    for g in goals:
        state = "– (not run, or failed)" if g["met"] is None else ("met" if g["met"] else "MISSED")
        note = f"  [{g['note']}]" if g["note"] else ""
        print(f"  {g['goal']:<40} {fmt_num(g['value'], '.2f'):>6}  {'<=' if g['at_most'] else '>='} "
              f"{g['target']:.2f}  {state}{note}")
