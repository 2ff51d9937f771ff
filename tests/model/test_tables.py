"""dtrain.model.tables: the seeded chunked initialisation (the same rows wherever they live) and
the gathered form (the same outputs and the same row gradients as torch's nn.Embedding /
nn.EmbeddingBag on the full table). Pure torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.model.tables import CHUNK_ROWS, Table, global_rows, init_rows, tables_of

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

N = CHUNK_ROWS * 2 + 123  # three chunks, the last one short


def test_init_is_the_same_for_any_ps_count_and_partition():
    full = init_rows(7, "0.weight", N, 3, 0.5, range(N))
    assert full.shape == (N, 3)
    assert 0.45 < float(full.std()) < 0.55
    for num_parts in (1, 2, 5):
        for strategy in ("mod", "div"):
            for p in range(num_parts):
                rows = global_rows(N, num_parts, p, strategy)
                assert torch.equal(init_rows(7, "0.weight", N, 3, 0.5, rows), full[rows.start:rows.stop:rows.step])
    some = torch.tensor([0, 5, CHUNK_ROWS - 1, CHUNK_ROWS, N - 1])  # an increasing tensor of ids
    assert torch.equal(init_rows(7, "0.weight", N, 3, 0.5, some), full[some])


def test_init_depends_on_seed_and_table_name_not_on_the_global_rng():
    a = init_rows(7, "0.weight", 1000, 4, 1.0, range(1000))
    torch.manual_seed(123)
    assert torch.equal(a, init_rows(7, "0.weight", 1000, 4, 1.0, range(1000)))
    assert not torch.equal(a, init_rows(8, "0.weight", 1000, 4, 1.0, range(1000)))
    assert not torch.equal(a, init_rows(7, "1.weight", 1000, 4, 1.0, range(1000)))
    with pytest.raises(ValueError, match="outside the table"):
        init_rows(7, "0.weight", 1000, 4, 1.0, range(990, 1001))


def test_full_table_holds_the_seeded_rows():
    t = Table(500, 4, name="0.weight", seed=3, init_std=0.2)
    assert torch.equal(t.weight.detach(), init_rows(3, "0.weight", 500, 4, 0.2, range(500)))


@pytest.mark.parametrize(("kind", "mode"), [("embedding", "mean"), ("embedding_bag", "sum"),
                                            ("embedding_bag", "mean")])
def test_gathered_form_matches_torch_on_the_full_table(kind, mode):
    full = Table(300, 6, kind=kind, mode=mode, name="0.weight", seed=1)
    ref = (nn.Embedding(300, 6, sparse=True) if kind == "embedding"
           else nn.EmbeddingBag(300, 6, mode=mode, sparse=True))
    with torch.no_grad():
        ref.weight.copy_(full.weight)
    x = torch.tensor([[3, 3, 250], [17, 3, 299], [0, 17, 17]])
    target = torch.randn(ref(x).shape, generator=torch.Generator().manual_seed(0))
    ((ref(x) - target) ** 2).sum().backward()
    dense_grad = ref.weight.grad.to_dense()

    gathered = Table(300, 6, kind=kind, mode=mode, name="0.weight", seed=1, gathered=True)
    assert not list(gathered.parameters())
    ids = torch.unique(x)
    gathered.gather(ids, full.weight.detach()[ids])
    out = gathered(x)
    assert torch.allclose(out, ref(x), atol=1e-6)
    ((out - target) ** 2).sum().backward()
    assert torch.allclose(gathered.rows.grad, dense_grad[ids], atol=1e-6)
    assert not dense_grad[[i for i in range(300) if i not in set(ids.tolist())]].any()


def test_gathered_table_refuses_ids_it_was_not_given_and_float_features():
    t = Table(100, 2, name="0.weight", gathered=True)
    with pytest.raises(RuntimeError, match="no rows gathered"):
        t(torch.tensor([[1]]))
    t.gather(torch.tensor([1, 5]), torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="ids that were not gathered"):
        t(torch.tensor([[1, 6]]))
    with pytest.raises(TypeError, match="takes integer ids, got torch.float32"):
        t(torch.tensor([[1.0, 5.0]]))


def test_make_full_and_tables_of():
    model = nn.Sequential(Table(50, 3, name="0.weight", gathered=True), nn.Flatten(), nn.Linear(6, 1))
    assert [n for n, _ in tables_of(model)] == ["0.weight"]
    weight = torch.randn(50, 3)
    model[0].make_full(weight)
    assert set(dict(model.named_parameters())) == {"0.weight", "2.weight", "2.bias"}
    assert model(torch.tensor([[1, 2]])).shape == (1, 1)
    assert torch.equal(model[0](torch.tensor([[4, 9]]))[0], weight[[4, 9]])
