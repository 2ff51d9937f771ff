"""Tables without a vocabulary on one ps task (dtrain.ps.dynamic) and their index (dtrain.ps.idmap),
without a cluster: rows by id, deterministic initial rows, admission, the cap, eviction, state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.model.ids import home_part, id_rows
from dtrain.ps.dynamic import DynamicTablePart
from dtrain.ps.idmap import IdMap

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
ADAGRAD = {"name": "adagrad", "lr": 0.1}


def part(num_parts: int = 1, index: int = 0, **kw) -> DynamicTablePart:
    args = {"max_rows": 10_000, **kw}
    return DynamicTablePart("t.weight", 4, num_parts, index, 0.5, 3, ADAGRAD, **args)


def mine(ids: torch.Tensor, num_parts: int, index: int) -> torch.Tensor:
    return ids[home_part(ids, num_parts) == index]


def test_the_id_map_agrees_with_a_dict_through_puts_removes_and_rebuilds():
    rng = np.random.default_rng(0)
    m, ref = IdMap(), {}
    for r in range(40):
        ids = np.unique(rng.integers(0, 2**63 - 1, 2000, dtype=np.int64))
        ids = ids[m.get(ids) < 0]
        slots = np.arange(len(ref) + r * 10_000, len(ref) + r * 10_000 + len(ids))
        m.put(ids, slots)
        ref.update(zip(ids.tolist(), slots.tolist(), strict=True))
        if r % 4 == 0:  # tombstones, then rebuilds as the map fills
            gone = np.array(list(ref)[:700])
            m.remove(gone)
            for i in gone.tolist():
                del ref[i]
    keys = np.array(list(ref), dtype=np.int64)
    assert (m.get(keys) == np.array(list(ref.values()))).all()
    assert m.size == len(ref)
    absent = rng.integers(0, 2**63 - 1, 1000, dtype=np.int64)
    absent = absent[~np.isin(absent, keys)]
    assert (m.get(absent) == -1).all()


def test_a_new_row_starts_at_its_ids_own_initial_value_whatever_the_order():
    p = part()
    ids = torch.tensor([5, 10**15, 7, 2**62])
    rows = p.gather(ids)
    assert torch.equal(rows, id_rows(3, "t.weight", ids, 4, 0.5))
    q = part()
    assert torch.equal(q.gather(ids.flip(0)), rows.flip(0))  # arrival order does not matter
    assert float(rows.std()) > 0.1  # (not zeros)


def test_rows_are_the_same_whatever_the_ps_count():
    ids = torch.arange(0, 3000, 7)
    one = part().gather(ids)
    out = torch.empty_like(one)
    for index in range(3):
        sel = home_part(ids, 3) == index
        out[sel] = part(3, index).gather(ids[sel])
    assert torch.equal(out, one)
    assert part(3, 1).check_ids(mine(ids, 3, 0)[:1]) is not None  # another task's id is refused


def test_min_count_keeps_rare_ids_out_until_seen_often_enough():
    p = part(min_count=3)
    ids = torch.tensor([1, 2, 3])
    assert not p.gather(ids).any() and p.live_rows == 0  # seen once: zeros, no row
    p.add_grad(ids, torch.ones(3, 4))
    p.apply()
    assert p.counters["rejected"] == 3 and p.live_rows == 0  # their gradients were dropped
    p.gather(torch.tensor([1, 2]))
    rows = p.gather(torch.tensor([1, 2, 3]))  # 1 and 2 seen 3 times: admitted; 3 twice: not
    assert p.live_rows == 2 and p.counters["admitted"] == 2
    assert rows[:2].abs().sum() > 0 and not rows[2].any()


def test_the_cap_holds_and_least_recently_used_rows_go_first():
    p = part(max_rows=100)
    hot = torch.arange(10)
    for step in range(20):
        p.gather(torch.cat([hot, torch.arange(1000 + step * 30, 1000 + step * 30 + 30)]))
        p.apply()
        assert p.live_rows <= 100
    assert p.counters["evicted"] > 0
    assert p.counters["admitted"] - p.counters["evicted"] == p.live_rows
    assert (p.index.get(hot.numpy()) >= 0).all()  # touched every step: never evicted
    assert len(p.ids) <= 100  # storage never grew past the cap


def test_rows_untouched_for_ttl_steps_are_evicted():
    p = part(ttl_steps=8)
    p.gather(torch.tensor([1, 2]))
    for _ in range(20):
        p.gather(torch.tensor([1]))
        p.apply()
    assert (p.index.get(np.array([1])) >= 0).all() and (p.index.get(np.array([2])) < 0).all()
    assert p.counters["evicted"] == 1


def test_updates_equal_a_fixed_tables_adagrad_on_the_same_ids():
    """A dynamic part behaves as a fixed table whose row i starts at id_rows(i) (min_count 1)."""
    ids = torch.tensor([3, 9, 40])
    p = part()
    weight = id_rows(3, "t.weight", torch.arange(50), 4, 0.5).requires_grad_(True)
    opt = torch.optim.Adagrad([weight], lr=0.1)
    rng = torch.Generator().manual_seed(0)
    for _ in range(5):
        p.gather(ids)
        g = torch.randn(3, 4, generator=rng)
        p.add_grad(ids, g)
        p.apply()
        weight.grad = torch.sparse_coo_tensor(ids[None], g, (50, 4))
        opt.step()
    assert torch.allclose(p.lookup(ids), weight.detach()[ids], atol=1e-6)


def test_state_round_trip_and_regrouping_onto_other_ps_counts():
    ids = torch.arange(0, 5000, 3)
    parts = [part(2, i) for i in range(2)]
    for i, p in enumerate(parts):
        p.gather(mine(ids, 2, i))
        p.add_grad(mine(ids, 2, i), torch.ones(len(mine(ids, 2, i)), 4))
        p.apply()
    states = [p.state() for p in parts]
    whole = {k: torch.cat([s[k] for s in states]) for k in ("ids", "weight", "last", "freq")}
    whole["optimizer"] = {"step": 1, "sum": torch.cat([s["optimizer"]["sum"] for s in states])}
    for count in (3, 1):
        again = [part(count, i) for i in range(count)]
        for p in again:
            p.load_state(whole)
        assert sum(p.live_rows for p in again) == len(ids)
        got = torch.empty(len(ids), 4)
        for i, p in enumerate(again):
            sel = home_part(ids, count) == i
            got[sel] = p.lookup(ids[sel])
            assert float(p.optimizer.sum[: p.live_rows].min()) == 1.0  # the accumulators came along
        want = torch.cat([parts[i].lookup(ids[home_part(ids, 2) == i]) for i in range(2)])
        order = torch.cat([torch.nonzero(home_part(ids, 2) == i).flatten() for i in range(2)])
        assert torch.equal(got[order], want)


def test_a_state_larger_than_the_cap_is_refused():
    p = part(max_rows=10_000)
    p.gather(torch.arange(500))
    with pytest.raises(ValueError, match="more than its cap of 100"):
        part(max_rows=100).load_state(p.state())


def test_the_plan_counts_at_least_what_a_full_part_allocates():
    """The plan's bytes for a part (the memory check before start) cover a part filled to its cap,
    index, sketch and optimizer state included, for float32 and bfloat16 rows."""
    from dtrain.model.tables import Table
    from dtrain.plan.tables import plan_tables

    for storage in ("float32", "bfloat16"):
        table = Table(0, 8, kind="embedding_bag", mode="sum", name="t.weight", device="meta", storage=storage,
                      optimizer={"name": "rowwise_adagrad", "lr": 0.1},
                      dynamic={"max_rows": 4000, "min_count": 2})
        (planned,) = plan_tables([("t.weight", table)], "ps", 2, "mod")
        p = DynamicTablePart("t.weight", 8, 2, 0, 0.5, 3, {"name": "rowwise_adagrad", "lr": 0.1}, max_rows=4000,
                             min_count=2, storage=storage)
        ids = mine(torch.arange(0, 40_000), 2, 0)
        for _ in range(3):  # seen often enough to be admitted, far past the cap
            p.gather(ids)
        assert p.live_rows == 2000 and p.counters["evicted"] > 0
        assert p.nbytes <= planned.parts[0].bytes, (storage, p.nbytes, planned.parts[0].bytes)
