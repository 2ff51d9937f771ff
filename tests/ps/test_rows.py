"""dtrain.ps.rows: a ps task's rows of a sparse table and the row optimizers, against torch's own
sparse path (``nn.Embedding(sparse=True)`` with torch.optim.SGD / Adagrad / SparseAdam), step by
step, with the table split over several parts. No cluster: pure torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.model.tables import global_rows
from dtrain.ps.rows import ROW_STATE, TablePart, make_row_optimizer

# torch's own sparse Adagrad (the reference) warns about its sparse invariant checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

N, D = 97, 5  # a prime row count: the parts are uneven under both strategies

OPTIMIZERS = {
    "sgd": ({"name": "sgd", "lr": 0.3}, lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": ({"name": "adagrad", "lr": 0.2, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-8},
                lambda p: torch.optim.Adagrad(p, lr=0.2, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8)),
    "adam": ({"name": "adam", "lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6},
             lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.8, 0.95), eps=1e-6)),
}


def parts(num_parts: int, strategy: str, config: dict, seed: int = 3) -> list[TablePart]:
    return [TablePart("0.weight", N, D, num_parts, p, strategy, 0.5, seed, config) for p in range(num_parts)]


def assemble(table_parts: list[TablePart]) -> torch.Tensor:
    out = torch.empty((N, D))
    for part in table_parts:
        out[torch.tensor(list(part.rows))] = part.weight
    return out


def owner(ids: torch.Tensor, num_parts: int, strategy: str) -> torch.Tensor:
    if strategy == "mod":
        return ids % num_parts
    bounds = torch.tensor([r.stop for r in (global_rows(N, num_parts, p, "div") for p in range(num_parts))][:-1])
    return torch.bucketize(ids, bounds, right=True)


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_partitions_cover_every_id_once(strategy):
    for num_parts in (1, 2, 3, 7):
        held = [i for p in range(num_parts) for i in global_rows(N, num_parts, p, strategy)]
        assert sorted(held) == list(range(N))
    sizes = [len(global_rows(10, 3, p, strategy)) for p in range(3)]
    assert sizes == [4, 3, 3]  # TensorFlow: the first N % P parts hold one row more (div); mod: ids p, p+3, ...
    assert list(global_rows(10, 3, 1, strategy)) == ([1, 4, 7] if strategy == "mod" else [4, 5, 6])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("num_parts", "strategy"), [(1, "mod"), (3, "mod"), (3, "div")])
def test_row_optimizers_follow_torch_sparse_step_by_step(name, num_parts, strategy):
    config, make_torch = OPTIMIZERS[name]
    table_parts = parts(num_parts, strategy, config)
    emb = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(assemble(table_parts))
    opt = make_torch(emb.parameters())
    g = torch.Generator().manual_seed(11)
    part0 = torch.tensor(list(table_parts[0].rows))
    for step in range(8):
        # repeated ids within a batch, two pushes a step (two replicas); at step 4 only part 0's rows
        # are touched: the other parts see an empty step, which must still count (SparseAdam)
        pushes = [part0[torch.randint(0, len(part0), (6, 3), generator=g)] if step == 4
                  else torch.randint(0, N, (6, 3), generator=g) for _ in range(2)]
        opt.zero_grad()
        for ids in pushes:
            target = torch.randn(6, 3, D, generator=g)
            ((emb(ids) - target) ** 2).sum().backward()
            # what a replica pushes: unique ids and their summed row gradients, from its own backward
            uniq, inverse = torch.unique(ids, return_inverse=True)
            leaf = emb.weight.detach()[uniq].requires_grad_()
            ((leaf[inverse] - target) ** 2).sum().backward()
            where = owner(uniq, num_parts, strategy)
            for p, part in enumerate(table_parts):
                mine = where == p
                assert part.check_ids(uniq[mine]) is None
                part.add_grad(uniq[mine], leaf.grad[mine])
        opt.step()
        for part in table_parts:
            part.apply()
        assert torch.allclose(assemble(table_parts), emb.weight.detach(), atol=1e-6, rtol=1e-5), (name, step)
    assert all(part.optimizer.step_count == 8 for part in table_parts)


def test_a_step_without_rows_still_counts_for_lazy_adam():
    """SparseAdam's bias correction uses the table's step; a part no batch touched for a step
    must still advance it, or its rows' later updates would be sized for an earlier step."""
    part = parts(1, "mod", OPTIMIZERS["adam"][0])[0]
    part.apply()
    part.apply()
    before = part.weight.clone()
    part.add_grad(torch.tensor([5]), torch.ones(1, D))
    part.apply()
    step = part.optimizer.step_count
    assert step == 3
    b1, b2, lr, eps = 0.8, 0.95, 0.05, 1e-6
    m, v = (1 - b1) * 1.0, (1 - b2) * 1.0
    expected = before[5] - lr * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step) * m / (v ** 0.5 + eps)
    assert torch.allclose(part.weight[5], expected, atol=1e-6)
    assert torch.equal(part.weight[:5], before[:5]) and torch.equal(part.weight[6:], before[6:])


def test_scale_divides_the_summed_gradient():
    a, b = parts(1, "mod", {"name": "sgd", "lr": 1.0}), parts(1, "mod", {"name": "sgd", "lr": 1.0})
    ids, grad = torch.tensor([2, 9]), torch.full((2, D), 4.0)
    a[0].add_grad(ids, grad)
    a[0].add_grad(ids, grad)
    a[0].apply(scale=0.5)
    b[0].add_grad(ids, grad)
    b[0].apply()
    assert torch.equal(a[0].weight, b[0].weight)  # the mean of two equal pushes is one push
    assert not torch.equal(a[0].weight, parts(1, "mod", {"name": "sgd", "lr": 1.0})[0].weight)


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_ids_are_checked(strategy):
    part = parts(3, strategy, {"name": "sgd", "lr": 0.1})[1]
    mine = torch.tensor(list(part.rows)[:3])
    assert part.check_ids(mine) is None
    assert part.check_ids(torch.tensor([], dtype=torch.int64)) is None
    for bad in (-1, N, 10**9):
        message = part.check_ids(torch.cat([mine, torch.tensor([bad])]))
        assert message is not None and f"id {bad} is outside table 0.weight" in message and "ids 0..96" in message
    other = next(i for i in range(N) if i not in part.rows)
    assert f"id {other} is not on ps part 1" in part.check_ids(torch.tensor([other]))


def test_state_round_trip_continues_identically():
    config = OPTIMIZERS["adagrad"][0]
    a = parts(2, "div", config)[0]
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        a.add_grad(torch.tensor([0, 7, 30]), torch.randn(3, D, generator=g))
        a.apply()
    b = parts(2, "div", config, seed=99)[0]  # other initial values: all of them must come from the state
    live, copied = a.state(), a.state(copy=True)
    assert live["weight"] is a.weight and copied["weight"] is not a.weight
    assert copied["optimizer"]["sum"] is not a.optimizer.sum and torch.equal(copied["optimizer"]["sum"], a.optimizer.sum)
    b.load_state(copied)
    for part in (a, b):
        part.add_grad(torch.tensor([7, 40]), torch.ones(2, D))
        part.apply()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.optimizer.sum, b.optimizer.sum)
    assert b.optimizer.step_count == 4
    other = parts(3, "div", config)[0]  # another ps count: another number of rows
    with pytest.raises(ValueError, match="another ps count or partition"):
        other.load_state(a.state())


def test_chunks_of_a_part_are_its_state():
    part = parts(2, "mod", OPTIMIZERS["adam"][0])[0]
    part.add_grad(torch.tensor([0, 10, 40]), torch.ones(3, D))
    part.apply()
    pieces = [part.chunk(lo, min(lo + 7, len(part.rows))) for lo in range(0, len(part.rows), 7)]
    state = part.state()
    assert torch.equal(torch.cat([p["weight"] for p in pieces]), state["weight"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(torch.cat([p["optimizer"][key] for p in pieces]), state["optimizer"][key])
    assert pieces[0]["optimizer"]["step"] == 1 and pieces[0]["weight"].data_ptr() != part.weight.data_ptr()


def test_nbytes_counts_rows_and_optimizer_state():
    assert parts(1, "mod", {"name": "sgd", "lr": 0.1})[0].nbytes == N * D * 4
    assert parts(1, "mod", OPTIMIZERS["adagrad"][0])[0].nbytes == 2 * N * D * 4
    assert parts(1, "mod", OPTIMIZERS["adam"][0])[0].nbytes == 3 * N * D * 4
    for name, (config, _) in OPTIMIZERS.items():  # what the ps memory check and the benchmark count
        assert parts(1, "mod", config)[0].nbytes == (1 + ROW_STATE[name]) * N * D * 4


@pytest.mark.parametrize(("config", "match"), [
    ({"name": "sgd", "lr": 0.1, "weight_decay": 0.01}, "weight_decay does not apply"),
    ({"name": "adam", "lr": 0.1, "amsgrad": True}, "amsgrad does not apply"),
    ({"name": "rmsprop", "lr": 0.1}, "'rmsprop' does not apply to sparse tables"),
])
def test_optimizers_without_a_sparse_form_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        make_row_optimizer(4, 2, config)
