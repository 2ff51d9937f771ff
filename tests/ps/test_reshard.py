"""A ps task's table parts restored from parts written under another partition (ps/reshard.py), on
the task itself: every row lands on the part that owns its id now, with its optimizer state and
step, through a chain (full, then a delta), ``mod`` and ``div`` either way, rows not drawn yet stay
undrawn, bfloat16 rows stay as they were; a table without a vocabulary keeps every live row and
its counters once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.model.ids import home_part
from dtrain.model.tables import global_rows
from dtrain.ps.dynamic import DynamicTablePart
from dtrain.ps.reshard import owned, restore_part
from dtrain.ps.rows import TablePart

N, D = 1000, 4
OPT = {"name": "adagrad", "lr": 0.1}


def part(n: int, p: int, strategy: str, init: str = "per_id", storage: str = "float32") -> TablePart:
    return TablePart("t.weight", N, D, n, p, strategy, 0.5, 7, OPT, storage=storage, init=init, track=True)


def train(parts: list[TablePart], strategy: str, rng: np.random.Generator, steps: int) -> None:
    n = len(parts)
    for _ in range(steps):
        ids = torch.from_numpy(np.unique(rng.zipf(1.2, 40) % N)).to(torch.int64)
        home = ids % n if strategy == "mod" else torch.searchsorted(
            torch.tensor([r.stop for r in (global_rows(N, n, q, strategy) for q in range(n))]), ids, right=True)
        for q, pt in enumerate(parts):
            mine = ids[home == q]
            pt.gather(ids[home == q][:2])  # (rows read, drawn)
            pt.add_grad(mine, torch.ones(len(mine), D))
            pt.apply()


def table(parts: list[TablePart], strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole table by id: rows (undrawn ones zero), adagrad sums, whether drawn."""
    w, s, drawn = torch.zeros(N, D), torch.zeros(N, D), torch.zeros(N, dtype=torch.bool)
    for q, pt in enumerate(parts):
        r = global_rows(N, len(parts), q, strategy)
        ids = torch.arange(r.start, r.stop, r.step)
        d = ~pt._fresh if pt._fresh is not None else torch.ones(len(ids), dtype=torch.bool)
        w[ids[d]] = pt.weight[d].to(torch.float32)
        s[ids] = pt.optimizer.tensors()["sum"]
        drawn[ids] = d
    return w, s, drawn


@pytest.mark.parametrize(("old", "new"), [((2, "mod"), (3, "div")), ((3, "div"), (2, "mod")), ((2, "mod"), (1, "mod")),
                                          ((1, "div"), (3, "mod"))])
@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_every_row_moves_to_its_new_part_through_a_chain(old, new, storage):
    rng = np.random.default_rng(1)
    before = [part(old[0], q, old[1], storage=storage) for q in range(old[0])]
    train(before, old[1], rng, 10)
    fulls = [pt.live_state() for pt in before]
    fulls = [{**st, "weight": st["weight"].clone(), "fresh": st["fresh"].clone(),
              "optimizer": {k: v.clone() if torch.is_tensor(v) else v for k, v in st["optimizer"].items()}}
             for st in fulls]
    for pt in before:
        pt.mark_clean()
    train(before, old[1], rng, 5)
    chains = [[full, pt.delta_state()] for full, pt in zip(fulls, before, strict=True)]
    after = [part(new[0], q, new[1], storage=storage) for q in range(new[0])]
    for q, pt in enumerate(after):
        restore_part(pt, chains, N, old, new, q)
    w0, s0, d0 = table(before, old[1])
    w1, s1, d1 = table(after, new[1])
    assert torch.equal(d0, d1) and 0 < int(d1.sum()) < N  # drawn rows drawn, undrawn ones still undrawn
    assert torch.equal(w0, w1) and torch.equal(s0, s1)
    assert {pt.optimizer.step_count for pt in after} == {15}


def test_owned_is_a_partition_of_the_rows():
    for old, new in [((2, "mod"), (3, "div")), ((3, "div"), (4, "mod"))]:
        seen = []
        for k in range(old[0]):
            r = global_rows(N, old[0], k, old[1])
            local = torch.arange(len(r))
            for p in range(new[0]):
                where, mine = owned(N, old, k, new, p, local)
                rn = global_rows(N, new[0], p, new[1])
                ids = local[where] * r.step + r.start
                assert torch.equal(ids, mine * rn.step + rn.start)  # the same ids, in the new part's numbering
                seen.append(ids)
        assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(N))  # each id once


def test_a_table_without_a_vocabulary_keeps_every_live_row_and_its_counters_once():
    def dyn(n, p):
        return DynamicTablePart("d.weight", D, n, p, 0.5, 7, OPT, max_rows=600, ttl_steps=4, track=True)

    rng = np.random.default_rng(2)
    before = [dyn(2, 0), dyn(2, 1)]
    for step in range(12):
        ids = torch.from_numpy(np.unique(rng.zipf(1.3, 30) * 13)).to(torch.int64)
        for q, pt in enumerate(before):
            mine = ids[home_part(ids, 2) == q]
            pt.gather(mine)
            pt.add_grad(mine, torch.ones(len(mine), D))
            pt.apply()
        if step == 5:
            fulls = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in pt.live_state().items()} for pt in before]
            for full, pt in zip(fulls, before, strict=True):
                full["optimizer"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in pt.optimizer.state_dict().items()}
                pt.mark_clean()
    chains = [[full, pt.delta_state()] for full, pt in zip(fulls, before, strict=True)]
    assert any(len(c[1]["evicted"]) for c in chains)  # (ttl 4: rows went between the two)
    after = [dyn(3, q) for q in range(3)]
    for q, pt in enumerate(after):
        restore_part(pt, chains, None, (2, "hash"), (3, "hash"), q)

    def rows(parts):
        live = [pt.chunk(0, len(pt.ids)) for pt in parts]
        ids = torch.cat([x["ids"] for x in live])
        order = torch.argsort(ids)
        return ids[order], torch.cat([x["weight"] for x in live])[order], torch.cat([x["last"] for x in live])[order]

    for a, b in zip(rows(before), rows(after), strict=True):
        assert torch.equal(a, b)
    total = {k: sum(pt.counters[k] for pt in before) for k in before[0].counters}
    assert after[0].counters == total and all(not any(pt.counters.values()) for pt in after[1:])
    assert all(pt.clock == 12 for pt in after)
