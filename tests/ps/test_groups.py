"""dtrain.ps.groups: a table group against its tables' parts on their own (``TablePart``), bit for bit:
random steps of several pushes with repeated ids over several tables, every row optimizer,
float32 / bfloat16 / float16 storage, both partitions; the batched id check against
``check_ids``; per-table states in and out; parts restored at different steps; which tables
batch. No cluster: pure torch."""

from __future__ import annotations

import pytest
import torch

from dtrain.ps.groups import TableGroup, table_parts
from dtrain.ps.rows import TablePart

SIZES = {"a": 97, "b": 1, "c": 40, "d": 3, "e": 250}  # uneven parts, and parts without a row

OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.3, "weight_decay": 0.01},
    "adagrad": {"name": "adagrad", "lr": 0.2, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-8},
    "rowwise_adagrad": {"name": "rowwise_adagrad", "lr": 0.05, "weight_decay": 0.001},
    "adam": {"name": "adam", "lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6},
}


def configs(num_parts: int, part: int, strategy: str, storage: str = "float32", dim: int = 5) -> list[dict]:
    return [{"name": name, "num_embeddings": n, "dim": dim, "num_parts": num_parts, "part": part,
             "strategy": strategy, "init_std": 0.5, "seed": 3, "storage": storage, "init": "per_id"}
            for name, n in SIZES.items()]


def alone(cs: list[dict], optimizer: dict) -> dict[str, TablePart]:
    return {c["name"]: TablePart(**c, optimizer_config=optimizer) for c in cs}


def own_ids(part: TablePart, gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` ids of the part (repeats likely), as a replica would push them; none for an empty part."""
    if not len(part.rows):
        return torch.empty(0, dtype=torch.int64)
    k = torch.randint(0, len(part.rows), (n,), generator=gen)
    return torch.tensor(list(part.rows))[k]


def values(part: TablePart) -> torch.Tensor:
    """A part's rows as a checkpoint reads them (rows not drawn yet are drawn: per_id)."""
    return part.chunk(0, len(part.rows))["weight"]


def same(group: TableGroup, parts: dict[str, TablePart]) -> None:
    for name, mine in zip(group.names, group.parts, strict=True):
        theirs = parts[name]
        assert torch.equal(values(mine), values(theirs)), name
        a, b = mine.optimizer.state_dict(), theirs.optimizer.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                            else a[k] == b[k] for k in a), name


def train(group: TableGroup, parts: dict[str, TablePart], steps: int, seed: int = 0, pushes: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for _ in range(pushes):
            members, ids, grads = [], [], []
            for m, name in enumerate(group.names):
                if torch.rand((), generator=gen) < 0.2:
                    continue  # a batch without this table
                pushed = own_ids(parts[name], gen, 6)
                if not len(pushed):
                    continue
                g = torch.randn((len(pushed), group.dim), generator=gen)
                members.append(m)
                ids.append(pushed)
                grads.append(g)
                parts[name].add_grad(pushed, g)
            group.add_grad(members, ids, grads)
        scale = 1.0 if step % 2 else 1.0 / pushes
        group.apply(scale)
        for part in parts.values():
            part.apply(scale)
        same(group, parts)
        pulls = [own_ids(parts[name], gen, 4) for name in group.names]
        members = [m for m, p in enumerate(pulls) if len(p)]
        got = group.gather(members, [pulls[m] for m in members])
        for m, rows in zip(members, got, strict=True):
            assert torch.equal(rows, parts[group.names[m]].gather(pulls[m]))


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("num_parts", "part", "strategy"), [(1, 0, "mod"), (2, 1, "mod"), (3, 2, "div")])
def test_a_group_steps_as_its_tables_alone_bit_for_bit(storage, optimizer, num_parts, part, strategy):
    cs = configs(num_parts, part, strategy, storage)
    group = TableGroup(cs, OPTIMIZERS[optimizer])
    parts = alone(cs, OPTIMIZERS[optimizer])
    same(group, parts)  # the same initial rows, written into the group's buffer
    train(group, parts, steps=6)
    assert all(p.optimizer.step_count == 6 for p in group.parts)


def test_small_updates_round_stochastically_per_table():
    """bfloat16: updates far below half a gap still move rows, with each table's own stream."""
    cs = configs(2, 0, "mod", "bfloat16")
    group = TableGroup(cs, {"name": "sgd", "lr": 1e-4})
    parts = alone(cs, {"name": "sgd", "lr": 1e-4})
    before = torch.cat([values(p) for p in group.parts])  # (every row drawn: what changes is updates)
    train(group, parts, steps=3)
    assert not torch.equal(group.weight, before)


@pytest.mark.parametrize(("num_parts", "part", "strategy"), [(1, 0, "mod"), (2, 1, "mod"), (3, 1, "div")])
def test_the_batched_check_agrees_with_check_ids(num_parts, part, strategy):
    cs = configs(num_parts, part, strategy)
    group = TableGroup(cs, OPTIMIZERS["sgd"])
    gen = torch.Generator().manual_seed(1)
    good = [own_ids(p, gen, 5) for p in group.parts]
    members = [m for m, ids in enumerate(good) if len(ids)]
    assert group.valid(members, [good[m] for m in members]) and group.valid([], [])
    for m, name in enumerate(group.names):
        n = SIZES[name]
        for bad in (-1, n, n + 7, *(i for i in range(min(n, 6)) if i not in group.parts[m].rows)):
            ids = [good[k] for k in members] + [torch.tensor([bad])]
            assert not group.valid(members + [m], ids), (name, bad)
            assert group.parts[m].check_ids(torch.tensor([bad])) is not None


def test_gather_reads_rows_and_leaves_the_callers_ids_alone():
    group = TableGroup(configs(1, 0, "div"), OPTIMIZERS["sgd"])
    ids = torch.tensor([3, 0, 3])
    kept = ids.clone()
    (rows,) = group.gather([4], [ids])
    assert torch.equal(rows, values(group.parts[4])[[3, 0, 3]]) and torch.equal(ids, kept)
    assert group.gather([], []) == []


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_per_table_states_round_trip_through_the_group(storage):
    cs = configs(2, 0, "mod", storage)
    group = TableGroup(cs, OPTIMIZERS["rowwise_adagrad"])
    parts = alone(cs, OPTIMIZERS["rowwise_adagrad"])
    train(group, parts, steps=3)
    # A group part's state is a table's state: into a part of its own, and back into a fresh group.
    fresh = TableGroup(cs, OPTIMIZERS["rowwise_adagrad"])
    restored = alone(cs, OPTIMIZERS["rowwise_adagrad"])
    for name, part in zip(group.names, group.parts, strict=True):
        state = part.state(copy=True)
        assert state["weight"].shape == (len(part.rows), 5) and state["weight"].data_ptr() != part.weight.data_ptr()
        assert part.state()["weight"] is part.weight
        restored[name].load_state(state)
        fresh.parts[group.names.index(name)].load_state(part.state(copy=True))
        chunks = [part.chunk(lo, lo + 7) for lo in range(0, len(part.rows), 7)]
        if chunks:
            assert torch.equal(torch.cat([c["weight"] for c in chunks]), part.weight)
    same(fresh, restored)
    train(fresh, restored, steps=3, seed=5)  # and they go on as before
    train(group, parts, steps=3, seed=5)
    same(group, restored)


def test_parts_restored_at_different_steps_step_apart():
    cs = configs(2, 1, "mod")
    group = TableGroup(cs, OPTIMIZERS["adam"])  # (adam's bias correction reads the step)
    parts = alone(cs, OPTIMIZERS["adam"])
    train(group, parts, steps=2)
    for target in (group.parts[0], parts["a"]):  # one table restored from an older state
        target.optimizer.load_state_dict({**target.optimizer.state_dict(), "step": 0})
    train(group, parts, steps=3, seed=2)
    assert group.parts[0].optimizer.step_count == 3 and group.parts[1].optimizer.step_count == 5


def test_pushes_to_a_part_itself_join_the_groups_step():
    cs = configs(1, 0, "mod")
    group = TableGroup(cs, OPTIMIZERS["sgd"])
    parts = alone(cs, OPTIMIZERS["sgd"])
    for target in (group.parts[2], parts["c"]):
        target.add_grad(torch.tensor([5, 5, 1]), torch.ones(3, 5))
    group.add_grad([0], [torch.tensor([7])], [torch.ones(1, 5)])
    parts["a"].add_grad(torch.tensor([7]), torch.ones(1, 5))
    group.apply()
    for part in parts.values():
        part.apply()
    same(group, parts)
    group.add_grad([0], [torch.tensor([7])], [torch.ones(1, 5)])
    group.clear()
    group.apply()
    for part in parts.values():
        part.apply()
    same(group, parts)


def test_which_tables_batch():
    cs = configs(2, 0, "mod")
    cs[1] = {**cs[1], "dim": 4}  # another width
    cs[2] = {**cs[2], "optimizer": OPTIMIZERS["adam"]}  # its own optimizer
    cs.append({**cs[0], "name": "f", "storage": "bfloat16"})  # another storage dtype
    cs.append({"name": "g", "dim": 5, "num_parts": 2, "part": 0, "init_std": 0.5, "seed": 3,
               "dynamic": {"max_rows": 100}})  # no vocabulary
    cs.append({**cs[0], "name": "h", "optimizer": OPTIMIZERS["rowwise_adagrad"]})  # the run's optimizer, named
    tables, groups = table_parts(cs, OPTIMIZERS["rowwise_adagrad"])
    assert list(tables) == ["a", "b", "c", "d", "e", "f", "g", "h"]
    assert [g.names for g in groups] == [["a", "d", "e", "h"]]
    assert all(tables[n] is p for n, p in zip(groups[0].names, groups[0].parts, strict=True))
    assert type(tables["g"]).__name__ == "DynamicTablePart" and isinstance(tables["b"], TablePart)
    assert groups[0].nbytes == groups[0].weight.nbytes + groups[0].optimizer.row_sum.nbytes
    assert sum(tables[n].nbytes for n in groups[0].names) == groups[0].nbytes



def test_per_id_rows_are_drawn_on_first_use_and_untouched_rows_take_no_memory():
    """A per_id part of 20M rows starts without writing its rows (the process's RSS grows by the
    mark of rows not drawn, 1 byte a row, not by 640 MB of rows); a gather draws exactly the rows
    it reads (id_rows of their ids), and a checkpoint's chunk draws the rest."""
    import psutil

    from dtrain.model.ids import id_rows

    me = psutil.Process()
    before = me.memory_info().rss
    part = TablePart("big.weight", 40_000_000, 8, 2, 1, "mod", 0.5, 3, OPTIMIZERS["sgd"], init="per_id")
    grown = me.memory_info().rss - before
    assert grown < 100 * 2**20, grown  # (eager: 20M x 8 float32 rows = 640 MB)
    ids = torch.tensor([1, 39_999_999, 77, 1])
    assert torch.equal(part.gather(ids), id_rows(3, "big.weight", ids, 8, 0.5))
    assert int((~part._fresh).sum()) == 3  # rows 0, 38, 19999999 only
    small = TablePart("t.weight", 30, 4, 2, 0, "mod", 0.5, 3, OPTIMIZERS["sgd"], init="per_id")
    assert torch.equal(small.chunk(0, 15)["weight"], id_rows(3, "t.weight", torch.arange(0, 30, 2), 4, 0.5))


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_a_part_drawn_at_start_holds_what_first_use_draws(storage, strategy):
    """``draw_all`` (a ps task's small parts, drawn as it starts) writes every row as ``ensure``
    writes it on first use, bit for bit, and leaves rows already drawn (and updated) alone."""
    def part():
        return TablePart("t.weight", 1001, 4, 3, 1, strategy, 0.5, 3, OPTIMIZERS["sgd"], init="per_id",
                         storage=storage)

    lazy, eager = part(), part()
    lazy.ensure(torch.arange(len(lazy.rows)))
    eager.draw_all()
    assert torch.equal(eager.weight, lazy.weight) and not bool(eager._fresh.any())
    touched = part()
    touched.ensure(torch.tensor([0, 5]))
    touched.weight[0] = 7.0  # an updated row: never drawn again
    touched.draw_all()
    assert bool((touched.weight[0] == 7.0).all()) and torch.equal(touched.weight[1:], lazy.weight[1:])


@pytest.mark.parametrize(("num_parts", "part", "strategy"), [(1, 0, "mod"), (2, 1, "mod"), (4, 3, "mod"),
                                                         (3, 2, "mod"), (3, 1, "div")])
def test_checked_rows_are_the_rows_of_valid_ids_and_none_for_any_bad_one(num_parts, part, strategy):
    """The batched path's one pass (``checked_rows``: a power of two of parts by shifts, others by
    division, div by ranges; ``valid_flat`` is its check) against ``rows_of`` and ids made bad by
    hand (``check_ids`` is the other reference: the test above). Fails if an id off this part,
    past its table, negative, or of a table without a row here passes, or if a valid id gets
    another row than ``rows_of`` gives it."""
    group = TableGroup(configs(num_parts, part, strategy), OPTIMIZERS["sgd"])
    gen = torch.Generator().manual_seed(num_parts * 10 + part)
    which = torch.randint(0, len(group.parts), (400,), generator=gen)
    own = [torch.tensor(list(p.rows), dtype=torch.int64) for p in group.parts]
    good = torch.stack([own[m][torch.randint(0, len(own[m]), (1,), generator=gen)][0] if len(own[m]) else
                        torch.tensor(-1) for m in which.tolist()])
    keep = good >= 0
    flat, which = good[keep], which[keep]
    rows = group.checked_rows(flat, which)
    assert rows is not None and torch.equal(rows, group.rows_of(flat, which)) and group.valid_flat(flat, which)
    sizes = torch.tensor(list(SIZES.values()))[which]
    if strategy == "mod":
        past = sizes + (part - sizes) % num_parts  # past the table, on this part's residue
        elsewhere = flat + 1  # (every other residue belongs to another part)
    else:
        lo = torch.tensor([p.rows.start for p in group.parts])[which]
        hi = torch.tensor([p.rows.stop for p in group.parts])[which]
        past = sizes
        elsewhere = torch.where(lo > 0, lo - 1, hi)  # the neighbouring part's first or last id
    cases = {"past its table": past, "negative": part - num_parts + 0 * flat}
    if num_parts > 1:
        cases["on another part"] = elsewhere
    for why, bad in cases.items():
        for k in (0, len(flat) // 2, len(flat) - 1):  # one bad id anywhere spoils the request
            ids = flat.clone()
            ids[k] = bad[k]
            assert not group.valid_flat(ids, which), (why, k)
            assert group.checked_rows(ids, which) is None, (why, k, int(ids[k]))


@pytest.mark.parametrize(("num_parts", "part", "strategy"), [(2, 1, "mod"), (3, 2, "mod"), (3, 1, "div")])
def test_a_request_side_by_side_trains_as_the_same_request_per_table(num_parts, part, strategy):
    """A replica's request as one SparseBlock (every table's entries in three tensors) takes the
    group's batched path; the same request per table the per-table one. Fails if the batched
    path maps an id to another table's row (a wrong member per id), sums or scales its gradients
    otherwise, or returns the wanted rows in another order; and if a bad id in a block is not
    named with its table (the check must fall back to the per-table message)."""
    from dtrain.dataplane.rows import SparseBlock
    from dtrain.ps.sparse import ShardTables

    cs = configs(num_parts, part, strategy, dim=3)
    batched, per_table = (ShardTables(cs, OPTIMIZERS["rowwise_adagrad"]) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    names = ["e", "a", "c", "b"]  # not the group's order; "b" has no row on parts but the first
    for _step in range(4):
        for table in (batched, per_table):
            table.clear()
        for _replica in range(2):
            request = {}
            for name in names:
                pushed = torch.unique(own_ids(per_table[name], gen, 5))
                request[name] = (pushed, torch.randn((len(pushed), 3), generator=gen), own_ids(per_table[name], gen, 4))
            block = SparseBlock.of(request)
            assert batched._one_group(block) is not None
            assert batched.why_bad(block) is None and per_table.why_bad(request) is None
            batched.add(block)
            per_table.add(request)
        batched.apply(0.5)
        per_table.apply(0.5)
        got, want = batched.gather(block), per_table.gather(request)
        assert isinstance(got, torch.Tensor) and isinstance(want, dict)
        assert torch.equal(got, torch.cat([want[name] for name in names]))
    for name in names:
        assert torch.equal(values(batched[name]), values(per_table[name])), name
    mine = int(own_ids(per_table["a"], gen, 1)[0])
    other = next(i for i in range(SIZES["a"]) if i not in per_table["a"].rows)  # on another part
    bad = SparseBlock.of({"a": (None, None, torch.tensor([mine, other]))})
    assert batched.why_bad(bad) == per_table.why_bad({"a": (None, None, torch.tensor([mine, other]))})
    assert f"id {other}" in (batched.why_bad(bad) or "") and "table a" in (batched.why_bad(bad) or "")
