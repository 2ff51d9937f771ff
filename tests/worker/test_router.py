"""The replica's table router without a cluster: every table's ids routed in one pass give the
requests (per part, per table: pushed ids, their row gradients, wanted ids) and install the rows
exactly as routing each table on its own does, for mod, div and hash partitions, tables of
several widths and over several parts, and tables a batch does not touch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.model.tables import Table
from dtrain.plan.tables import TablePartPlan, TablePlan
from dtrain.worker.tables import SparseRouter, TableRoute

# (rows, dim, parts) per table; the last one no batch touches
TABLES = [(50, 4, 2), (7, 4, 2), (300, 4, 3), (1, 4, 2), (40, 4, 3)]


class Tables(nn.Module):
    def __init__(self, dims: list[int]):
        super().__init__()
        self.tables = nn.ModuleList(Table(n, d, kind="embedding_bag", mode="sum", name=f"tables.{i}.weight",
                                          gathered=True) for i, (n, d) in enumerate(dims))

    def table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"tables.{i}.weight": torch.unique(x[:, i] % t.num_embeddings) if i < x.shape[1] else
                torch.empty(0, dtype=torch.int64) for i, t in enumerate(self.tables)}


def plans(tables: list[tuple[int, int, int]], partition: str) -> tuple[TablePlan, ...]:
    return tuple(TablePlan(f"tables.{i}.weight", "embedding_bag", n, d, 0.1, "sum", partition,
                           tuple(TablePartPlan(p, p, f"/job:ps/task:{p}", 0, 0, p) for p in range(parts)))
                 for i, (n, d, parts) in enumerate(tables))


def reference_requests(router: SparseRouter, grads: bool, current: list, nxt: list) -> list[dict]:
    """The per-table routing (one table, one part at a time)."""
    out: list[dict] = [{} for _ in range(router.num_shards)]
    for t, route in enumerate(router.routes):
        ids, nids = current[t], nxt[t]
        pos, npos = route.split(ids), route.split(nids)
        for p in range(route.num_parts):
            g = route.module.rows.grad if grads else None
            out[p][route.plan.name] = (ids[pos[p]] if grads else None, g[pos[p]] if grads else None, nids[npos[p]])
    return out


def fake_ps(requests: list[dict], weights: dict[str, torch.Tensor]) -> list[tuple]:
    return [(None, 0, False, 0, {name: weights[name][want % len(weights[name])] for name, (_i, _g, want) in r.items()})
            for r in requests]


@pytest.mark.parametrize("partition", ["mod", "div", "hash"])
@pytest.mark.parametrize("dims", [[4, 4, 4, 4, 4], [4, 2, 8, 4, 3]])
def test_one_pass_routing_equals_routing_each_table(partition, dims):
    tables = [(n, d, parts) for (n, _d, parts), d in zip(TABLES, dims, strict=True)]
    model = Tables([(n, d) for n, d, _ in tables])
    router = SparseRouter(model, plans(tables, partition), num_shards=3, device=torch.device("cpu"))
    weights = {f"tables.{i}.weight": torch.randn(n, d) for i, (n, d, _) in enumerate(tables)}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1000, (32, 4), generator=g) for _ in range(4)]
    router.plan_next(batches[0])
    router.take(fake_ps(router.requests(False), weights))
    for k in range(1, 4):
        current = [r.module.ids for r in router.routes]
        for r in router.routes:  # a backward's row gradients
            r.module.rows.grad = torch.randn(r.module.rows.shape, generator=g)
        router.plan_next(batches[k])
        nxt = [model.table_ids(batches[k])[r.plan.name] for r in router.routes]
        got, want = router.requests(True), reference_requests(router, True, current, nxt)
        assert [list(r) for r in got] == [list(r) for r in want]  # the same tables, in the same order
        for r_got, r_want in zip(got, want, strict=True):
            for name, entry in r_want.items():
                for a, b in zip(r_got[name], entry, strict=True):
                    assert torch.equal(a, b) and a.is_contiguous()
        router.take(fake_ps(got, weights))
        for i, r in enumerate(router.routes):
            assert torch.equal(r.module.ids, nxt[i])
            assert torch.equal(r.module.rows, weights[r.plan.name][nxt[i] % len(weights[r.plan.name])])
            assert r.module.rows.requires_grad and r.module.rows.is_leaf


def test_a_missing_part_is_named():
    model = Tables([(n, d) for n, d, _ in TABLES])
    router = SparseRouter(model, plans(TABLES, "mod"), num_shards=3, device=torch.device("cpu"))
    router.plan_next(torch.randint(0, 1000, (8, 4)))
    replies = fake_ps(router.requests(False), {f"tables.{i}.weight": torch.zeros(n, d)
                                               for i, (n, d, _) in enumerate(TABLES)})
    del replies[1][4]["tables.2.weight"]
    with pytest.raises(RuntimeError, match="ps shard 1 sent no rows of table tables.2.weight"):
        router.take(replies)


def test_table_route_parts():
    route = TableRoute(plans([(10, 2, 3)], "div")[0], Table(10, 2, gathered=True))
    assert route.part_of(torch.arange(10)).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
