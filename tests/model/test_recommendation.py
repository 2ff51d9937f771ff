"""The DLRM's lookup without a cluster: the records unpacked and the bags' index computed for a
batch's table ids serve that batch's forward (bit for bit what a fresh forward computes), and never
another batch's: a buffer refilled in place, a different tensor, or tables holding other rows. The
bags' sum (pooled_rows) has torch's embedding_bag values and gradients."""

from __future__ import annotations

import pytest
import torch

from dtrain.data.features import RecordLayout
from dtrain.model.recommendation import _DotInteraction, build_dlrm, pooled_rows, record_layout
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
    model._ahead = []
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
        assert model._ahead and model._ahead[-1][2].index is not None
        out = model(x)
        out.sum().backward()
        grads = {n: t.rows.grad for n, t in tables_of(model)}
        assert not model._ahead  # used once
        want, want_grads = reference(model, x, full)
        assert torch.equal(out.detach(), want)
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads)


def test_two_batches_routed_ahead_keep_their_lookups_for_their_forwards(models):
    """A replica routes the batch after next while the next waits for its rows: both lookups are
    kept, each used by its own forward. Fails if the second lookup evicts the first (the first
    forward would search again) or a forward takes the other batch's lookup."""
    model, full = models
    layout = record_layout(FEATURES)
    x0, x1 = batch(layout, 0), batch(layout, 1)
    ids0 = model.table_ids(x0)
    lookup0 = model._ahead[-1][2]
    model.table_ids(x1)
    lookup1 = model._ahead[-1][2]
    assert len(model._ahead) == 2 and model._ahead[0][0] is x0 and model._ahead[1][0] is x1
    gather(model, ids0, full)
    out0 = model(x0)
    assert len(model._ahead) == 1 and model._ahead[0][2] is lookup1 and lookup0 is not lookup1
    want, _ = reference(model, x0, full)
    assert torch.equal(out0.detach(), want)


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


def _bags(seed: int, num_rows: int = 30):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([2, 0, 3, 1, 0, 4, 3])  # empty bags inside and a non-empty last one
    index = torch.randint(0, num_rows, (int(sizes.sum()),), generator=g)
    index[:2] = 7  # an id twice in one bag
    index[-1] = 7  # and in another bag
    return g, index, torch.cumsum(sizes, 0) - sizes


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_rows_with_the_lookups_order_equal_embedding_bag(weighted):
    """The backward through the lookup's order (a forward embedding_bag over the positions sorted by
    row) against torch's embedding_bag and the index_add backward: fails if a row misses one of its
    positions, a run starts in the wrong place, or the weights are not reordered with the positions."""
    g, index, offsets = _bags(5)
    rows = torch.randn(30, 5, generator=g, dtype=torch.float64)
    weights = torch.rand(len(index), generator=g, dtype=torch.float64) if weighted else None
    order = torch.sort(index, stable=True).indices
    counts = torch.bincount(index, minlength=len(rows))  # rows 0 .. 29, some never looked up
    order_of = (order, torch.cumsum(counts, 0) - counts)
    upstream = torch.randn(len(offsets), 5, generator=g, dtype=torch.float64)
    ours, plain, ref = (rows.clone().requires_grad_() for _ in range(3))
    out = pooled_rows(ours, index, offsets, weights, order_of)
    expected = torch.nn.functional.embedding_bag(index, ref, offsets, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(out, expected)
    out.backward(upstream)
    pooled_rows(plain, index, offsets, weights).backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(ours.grad, ref.grad)
    torch.testing.assert_close(ours.grad, plain.grad)
    assert torch.autograd.gradcheck(lambda r: pooled_rows(r, index, offsets, weights, order_of),
                                    (rows.clone().requires_grad_(),))


def _interaction_inputs(seed: int, batch: int = 6, features: int = 4, dim: int = 3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n = features + 1
    rows, cols = torch.tril_indices(n, n, offset=-1)
    pairs = rows * n + cols
    spread = torch.zeros(n * n, dtype=torch.int64)
    spread[pairs] = torch.arange(1, len(pairs) + 1)
    spread[cols * n + rows] = spread[pairs]
    dense = torch.randn(batch, dim, generator=g, dtype=dtype)
    pooled = torch.randn(features, batch, dim, generator=g, dtype=dtype)
    return g, dense, pooled, pairs, spread


def test_the_dot_interaction_equals_the_plain_torch_expression():
    """Values bit for bit, gradients to rounding (one bmm over G + G^T instead of two): fails if a pair
    is spread to the wrong product, the diagonal takes a gradient, or the dense part's two gradients
    (its own columns and its products) are not added."""
    g, dense, pooled, pairs, spread = _interaction_inputs(0, batch=32, features=26, dim=16, dtype=torch.float32)
    a, b = (dense.clone().requires_grad_() for _ in range(2))
    p, q = (pooled.clone().requires_grad_() for _ in range(2))
    ours = _DotInteraction.apply(a, p, pairs, spread)
    stacked = torch.stack([b, *q.unbind(0)], dim=1)
    plain = torch.cat([b, torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1).index_select(1, pairs)], dim=1)
    assert torch.equal(ours, plain)
    upstream = torch.randn(plain.shape, generator=g)
    ours.backward(upstream)
    plain.backward(upstream)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_the_dot_interaction_gradients_pass_gradcheck():
    _g, dense, pooled, pairs, spread = _interaction_inputs(1)
    assert torch.autograd.gradcheck(lambda d, p: _DotInteraction.apply(d, p, pairs, spread),
                                    (dense.requires_grad_(), pooled.requires_grad_()))


def test_the_lookups_order_sorts_the_index_by_row_keeping_positions():
    model = build_dlrm(FEATURES, TABLES, DLRM, seed=3, gathered_tables=True)
    lookup = model.tables.lookup(record_layout(FEATURES).unpack(batch(record_layout(FEATURES), 4, n=64)))
    index, order, starts = lookup.index, lookup.order, lookup.starts
    assert index is not None and order is not None and starts is not None
    assert torch.equal(order, torch.sort(index, stable=True).indices)
    counts = torch.bincount(index, minlength=sum(len(i) for i in lookup.ids.values()))
    assert torch.equal(starts, torch.cumsum(counts, 0) - counts) and bool((counts > 0).all())


def test_the_evaluation_forward_matches_the_full_models():
    """No gradient (an evaluation): the gathered model's batched path computes the full model's logits."""
    model, full = build_dlrm(FEATURES, TABLES, DLRM, seed=3, gathered_tables=True), build_dlrm(FEATURES, TABLES, DLRM, seed=3)
    x = batch(record_layout(FEATURES), 2)
    with torch.no_grad():
        gather(model, model.table_ids(x), full)
        got, want = model(x), full(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
