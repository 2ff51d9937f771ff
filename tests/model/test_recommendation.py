"""The DLRM's lookup without a cluster: the records unpacked and the bags' index computed for a
batch's table ids serve that batch's forward (bit for bit what a fresh forward computes), and never
another batch's: a buffer refilled in place, a different tensor, or tables holding other rows. The
bags' sum (pooled_rows) has torch's embedding_bag values and gradients."""

from __future__ import annotations

import pytest
import torch

from dtrain.data.features import RecordLayout
from dtrain.model.recommendation import build_dlrm, pooled_rows, record_layout
from dtrain.model.tables import tables_of

FEATURES = {"dense": ["I1", "I2"],
            "categorical": [{"name": "C1", "table": "A", "max_ids": 3}, {"name": "C2", "table": "B"},
                            {"name": "C3", "table": "A", "max_ids": 2}]}
TABLES = {"A": {"num_embeddings": 40, "dim": 4}, "B": {"num_embeddings": 7, "dim": 4}, "U": {"num_embeddings": 5, "dim": 4}}
DLRM = {"bottom": [8, 4], "top": [8, 1]}


def batch(layout: RecordLayout, seed: int, n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1000, (n, layout.width), generator=g)
    x[:, :2] = torch.randn(n, 2, generator=g).view(torch.int32).to(torch.int64)  # dense values' bits
    x[::3, 3] = -1  # a padded slot of C1's list
    return x


def gather(model, ids: dict[str, torch.Tensor], full) -> None:
    weights = dict(tables_of(full))
    for name, table in tables_of(model):
        table.gather(ids[name], weights[name].weight.detach()[ids[name]])


@pytest.fixture
def models():
    full = build_dlrm(FEATURES, TABLES, DLRM, seed=3)
    return build_dlrm(FEATURES, TABLES, DLRM, seed=3, gathered_tables=True), full


def reference(model, x: torch.Tensor, full) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and the rows' gradients with no lookup kept (the searched path)."""
    model._ahead = None
    gather(model, {n: t.ids for n, t in tables_of(model)}, full)
    out = model(x)
    out.sum().backward()
    return out.detach(), {n: t.rows.grad for n, t in tables_of(model)}


def test_the_kept_lookup_computes_what_a_fresh_forward_does(models):
    model, full = models
    layout = record_layout(FEATURES)
    for seed in range(3):
        x = batch(layout, seed)
        ids = model.table_ids(x)
        assert ids["tables.U.weight"].numel() == 0  # a table no feature reads
        gather(model, ids, full)
        assert model._ahead is not None and model._ahead[2].index is not None
        out = model(x)
        out.sum().backward()
        grads = {n: t.rows.grad for n, t in tables_of(model)}
        assert model._ahead is None  # used once
        want, want_grads = reference(model, x, full)
        assert torch.equal(out.detach(), want)
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_a_stale_lookup_is_never_used(models):
    model, full = models
    layout = record_layout(FEATURES)
    x, other = batch(layout, 0), batch(layout, 1)
    both = {n: torch.unique(torch.cat([a, b])) for (n, a), b in
            zip(model.table_ids(other).items(), model.table_ids(x).values(), strict=True)}
    # the buffer refilled in place (a MemoryBatches buffer drawn again) after its ids were taken
    model.table_ids(x)
    x.copy_(other)
    gather(model, both, full)
    out = model(x)
    assert torch.equal(out, model(other.clone()))
    # tables holding other rows than the lookup's (another batch gathered in between)
    x = batch(layout, 0)
    model.table_ids(x)
    gather(model, both, full)
    assert torch.equal(model(x), model(x.clone()))


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_rows_equal_embedding_bag_in_values_and_gradients(weighted):
    """Fails if the index_add backward misses a bag's ids (wrong bag of an index: empty bags, the
    last bag), ignores the per-sample weights, or adds into the wrong rows."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(30, 5, generator=g, dtype=torch.float64)
    sizes = torch.tensor([2, 0, 3, 1, 0, 4])  # empty bags inside and a non-empty last one
    index = torch.randint(0, 30, (int(sizes.sum()),), generator=g)
    index[:2] = 7  # an id twice in one bag: its gradient counts twice
    offsets = torch.cumsum(sizes, 0) - sizes
    weights = torch.rand(len(index), generator=g, dtype=torch.float64) if weighted else None
    upstream = torch.randn(len(sizes), 5, generator=g, dtype=torch.float64)
    ours, ref = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out = pooled_rows(ours, index, offsets, weights)
    expected = torch.nn.functional.embedding_bag(index, ref, offsets, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(out, expected)
    out.backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(ours.grad, ref.grad)
