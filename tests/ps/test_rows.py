"""dtrain.ps.rows: a ps task's rows of a sparse table and the row optimizers, against torch's own
sparse path (``nn.Embedding(sparse=True)`` with torch.optim.SGD / Adagrad / SparseAdam), step by
step, with the table split over several parts; rowwise_adagrad and L2 on touched rows against
FBGEMM's formulas written out here; bfloat16 / float16 storage with stochastic rounding. No
cluster: pure torch."""

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
    ({"name": "adam", "lr": 0.1, "weight_decay": 0.01}, "weight_decay does not apply to adam"),
    ({"name": "adam", "lr": 0.1, "amsgrad": True}, "amsgrad does not apply"),
    ({"name": "rmsprop", "lr": 0.1}, "'rmsprop' does not apply to sparse tables"),
    ({"name": "rowwise_adagrad"}, "rowwise_adagrad for a sparse table needs lr"),
])
def test_optimizers_without_a_sparse_form_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        make_row_optimizer(4, 2, config)


# ------------------------------------------------------------- rowwise_adagrad, L2 on touched rows


def sparse_steps(num_rows: int, steps: int, seed: int = 7) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step two pushes of (ids, row gradients), ids repeated within and across the pushes."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, num_rows, (12,), generator=g), torch.randn(12, D, generator=g)) for _ in range(2)]
            for _ in range(steps)]


def summed(pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for ids, grads in pushes:
        for i, row in zip(ids.tolist(), grads.double(), strict=True):
            out[i] = out.get(i, torch.zeros(D, dtype=torch.float64)) + row
    return out


def reference(name: str, w: torch.Tensor, steps: list, lr: float, wd: float, eps: float) -> torch.Tensor:
    """The update rules written out row by row in float64 (FBGEMM's for rowwise_adagrad, with
    WeightDecayMode.L2; torch's sparse SGD / Adagrad with L2 added to the touched rows' gradient)."""
    w = w.double().clone()
    acc = torch.zeros(len(w), dtype=torch.float64) if name == "rowwise_adagrad" else torch.zeros_like(w)
    for pushes in steps:
        for r, g in summed(pushes).items():
            g_l2 = g + wd * w[r]
            if name == "sgd":
                w[r] = w[r] - lr * g_l2
            elif name == "adagrad":
                acc[r] += g_l2 ** 2
                w[r] = w[r] - lr * g_l2 / (acc[r].sqrt() + eps)
            else:
                acc[r] += (g_l2 ** 2).sum() / D
                multiplier = lr / (acc[r].sqrt() + eps)
                w[r] = (1 - multiplier * wd) * w[r] - multiplier * g
    return w


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_row_optimizers_match_the_reference_formulas(name, weight_decay):
    """rowwise_adagrad is FBGEMM's EXACT_ROWWISE_ADAGRAD (one accumulator per row of the mean squared
    gradient; a per-element accumulator or a sum instead of a mean fails); weight_decay is L2 on the
    touched rows only (decaying untouched rows, or dropping the decay, fails)."""
    config = {"name": name, "lr": 0.1, "eps": 1e-8, "weight_decay": weight_decay}
    if name == "sgd":
        del config["eps"]
    part = parts(1, "mod", config)[0]
    before = part.weight.clone()
    steps = sparse_steps(40, 20)  # ids below 40: rows 40..96 are never touched
    for pushes in steps:
        for ids, grads in pushes:
            part.add_grad(ids, grads)
        part.apply()
    expected = reference(name, before, steps, 0.1, weight_decay, 1e-8)
    assert torch.allclose(part.weight.double(), expected, atol=1e-6, rtol=0), (name, weight_decay)
    assert torch.equal(part.weight[40:], before[40:])  # untouched rows: no decay at all
    if name == "rowwise_adagrad":
        assert part.optimizer.row_sum.shape == (N,) and bool((part.optimizer.row_sum[:40] > 0).all())
        assert bool((part.optimizer.row_sum[40:] == 0).all())


def test_weight_decay_changes_the_touched_rows():
    """The reference test's weight_decay case is not vacuous: with decay the touched rows differ."""
    runs = []
    for wd in (0.0, 0.05):
        part = parts(1, "mod", {"name": "rowwise_adagrad", "lr": 0.1, "weight_decay": wd})[0]
        for pushes in sparse_steps(40, 3):
            for ids, grads in pushes:
                part.add_grad(ids, grads)
            part.apply()
        runs.append(part.weight[:40].clone())
    assert (runs[0] - runs[1]).abs().max() > 1e-4


# ------------------------------------------------------------------------------ row storage


def bf16_ulp(x: float) -> float:
    return 2.0 ** (torch.tensor(x).abs().log2().floor().item() - 7)


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_tiny_updates_accumulate_with_stochastic_rounding(storage):
    """1000 updates of 1e-4 each, far below half a bfloat16 gap at 1.0 (2**-8): round to nearest
    would drop every one (the row would stay 1.0); stochastic rounding moves it by their sum on
    average (+0.1). A biased rounding (always down, or up) fails the mean."""
    rows, steps, delta = 256, 1000, 1e-4
    assert float(torch.tensor(1.0 + delta).to(torch.bfloat16)) == 1.0  # what round-to-nearest would store
    part = TablePart("t", rows, D, 1, 0, "mod", 0.5, 3, {"name": "sgd", "lr": 1.0}, storage=storage)
    part.weight.fill_(1.0)
    ids, grad = torch.arange(rows), torch.full((rows, D), -delta)
    for _ in range(steps):
        part.add_grad(ids, grad)
        part.apply()
    moved = part.gather(ids) - 1.0
    assert part.weight.dtype == getattr(torch, storage)
    assert abs(float(moved.mean()) - steps * delta) < 0.006, float(moved.mean())
    assert float(moved.min()) >= 0.0  # every update is upward: never rounded below the value it started from


@pytest.mark.parametrize(("dtype", "x", "gap"), [
    (torch.bfloat16, 1.0 + 0.3 * 2 ** -7, 2 ** -7),
    (torch.bfloat16, -3.0 - 0.8 * 2 ** -6, 2 ** -6),
    (torch.bfloat16, 1e-40 + 0.0, 2 ** -133),  # a float32 subnormal: bfloat16 has the same exponent range
    (torch.float16, 1.0 + 0.3 * 2 ** -10, 2 ** -10),
    (torch.float16, -0.01, 2 ** -17),
    (torch.float16, 5.3 * 2 ** -24, 2 ** -24),  # a float16 subnormal: a fixed gap of 2**-24
    (torch.float16, -700.3 * 2 ** -24, 2 ** -24),
])
def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(dtype, x, gap):
    """Each value becomes one of its two neighbours in the storage dtype, the upper one (in
    magnitude) with probability equal to its distance from the lower, so the mean is the value
    (within 4 standard errors over 200,000 draws)."""
    from dtrain.ps.rows import round_stochastic

    n = 200_000
    value = torch.tensor(x, dtype=torch.float32)
    out = round_stochastic(value.repeat(n), dtype, torch.Generator().manual_seed(1)).to(torch.float64)
    lo = float(value.abs()) // gap * gap * (1 if x > 0 else -1)
    hi = lo + (gap if x > 0 else -gap)
    assert set(out.unique().tolist()) == {lo, hi}, out.unique()
    p = (float(value) - lo) / (hi - lo)
    assert abs(float((out == hi).double().mean()) - p) < 4 * (p * (1 - p) / n) ** 0.5
    assert abs(float(out.mean()) - float(value)) < 4 * gap * (p * (1 - p) / n) ** 0.5


def test_stochastic_rounding_edges():
    """Representable values stay as they are; NaN stays NaN; float16 overflows to inf as a cast does."""
    from dtrain.ps.rows import round_stochastic

    g = torch.Generator().manual_seed(0)
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.15625, float("inf"), float("-inf")])
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(round_stochastic(exact.clone(), dtype, g).float(), exact)
        assert bool(round_stochastic(torch.tensor([float("nan")] * 64), dtype, g).isnan().all())
    assert bool(round_stochastic(torch.tensor([70000.0]), torch.float16, g).isinf().all())


def trained(storage: str, seed: int, optimizer: dict | None = None) -> TablePart:
    part = TablePart("0.weight", N, D, 2, 1, "div", 0.5, seed, optimizer or {"name": "rowwise_adagrad", "lr": 0.05},
                     storage=storage)
    for pushes in sparse_steps(N, 6):
        for ids, grads in pushes:
            mine = ids >= part.rows.start  # part 1 of 2 (div) holds the upper rows
            part.add_grad(ids[mine], grads[mine])
        part.apply()
    return part


def test_the_rounding_stream_is_seeded():
    """The same run seed gives the same rows bit for bit (a run is reproducible for a fixed ps
    count); another seed draws other rounding bits (and other initial rows)."""
    a, b = trained("bfloat16", 3), trained("bfloat16", 3)
    assert torch.equal(a.weight, b.weight)
    c = TablePart("0.weight", N, D, 2, 1, "div", 0.5, 5, {"name": "sgd", "lr": 1.0}, storage="bfloat16")
    d = TablePart("0.weight", N, D, 2, 1, "div", 0.5, 4, {"name": "sgd", "lr": 1.0}, storage="bfloat16")
    c.weight.copy_(d.weight)  # the same rows, another seed: another stream
    for part in (c, d):
        part.add_grad(torch.tensor(list(part.rows)), torch.full((len(part.rows), D), 1e-3))
        part.apply()
    assert not torch.equal(c.weight, d.weight)


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_initial_rows_are_the_float32_table_rounded_to_nearest(storage, strategy, monkeypatch):
    """Drawn in float32 one initialisation chunk at a time (never the whole part in float32: a spy
    on init_rows sees at most one chunk of rows per call), stored rounded to nearest; the same
    values however the table is split."""
    from dtrain.model.tables import CHUNK_ROWS, init_rows
    from dtrain.ps import rows as rows_module

    n, dim = 2 * CHUNK_ROWS + 1001, 2
    sizes: list[int] = []

    def spy(*args, **kwargs):
        sizes.append(len(args[5]))
        return init_rows(*args, **kwargs)

    monkeypatch.setattr(rows_module, "init_rows", spy)
    full = init_rows(3, "big", n, dim, 0.5, range(n)).to(getattr(torch, storage))
    for p in range(3):
        part = TablePart("big", n, dim, 3, p, strategy, 0.5, 3, {"name": "sgd", "lr": 0.1}, storage=storage)
        ids = torch.tensor(list(part.rows))
        assert torch.equal(part.weight, full[ids])
    assert sizes and max(sizes) <= CHUNK_ROWS


def test_storage_bytes_and_float32_gather():
    """A bfloat16 part keeps 2 bytes per element and rowwise_adagrad 4 bytes per row; gather and
    the optimizer see float32."""
    part = trained("bfloat16", 3)
    rows = len(part.rows)
    assert part.weight.element_size() == 2 and part.optimizer.row_sum.dtype == torch.float32
    assert part.nbytes == rows * D * 2 + rows * 4
    assert part.gather(torch.tensor([part.rows.start])).dtype == torch.float32
    half = TablePart("0.weight", N, D, 1, 0, "mod", 0.5, 3, OPTIMIZERS["adam"][0], storage="float16")
    assert half.nbytes == N * D * 2 + 2 * N * D * 4
    with pytest.raises(ValueError, match="storage 'int8' is not one of 'float32', 'bfloat16', 'float16'"):
        TablePart("0.weight", N, D, 1, 0, "mod", 0.5, 3, {"name": "sgd", "lr": 0.1}, storage="int8")


def test_a_compact_part_round_trips_through_state_and_chunks():
    """state()/load_state() and chunk() carry bfloat16 rows and the (rows,) accumulator: a part
    restored from them continues bit for bit; chunks are slices of the state; a state of another
    row optimizer is refused; float32 rows load into a bfloat16 part rounded to nearest."""
    a = trained("bfloat16", 3)
    b = trained("bfloat16", 3)
    b.add_grad(torch.tensor([b.rows.start]), torch.ones(1, D))  # b drifts: its state must come from a's
    b.apply()
    copied = a.state(copy=True)
    assert copied["weight"].dtype == torch.bfloat16 and copied["optimizer"]["row_sum"].shape == (len(a.rows),)
    b.load_state(copied)
    for part in (a, b):
        part.add_grad(torch.tensor([a.rows.start, a.rows.start + 3]), torch.full((2, D), 0.01))
        part.apply()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.optimizer.row_sum, b.optimizer.row_sum)
    assert b.optimizer.step_count == a.optimizer.step_count == 7
    pieces = [a.chunk(lo, min(lo + 10, len(a.rows))) for lo in range(0, len(a.rows), 10)]
    assert torch.equal(torch.cat([p["weight"] for p in pieces]), a.weight)
    assert torch.equal(torch.cat([p["optimizer"]["row_sum"] for p in pieces]), a.optimizer.row_sum)
    assert pieces[0]["weight"].dtype == torch.bfloat16 and pieces[0]["optimizer"]["step"] == 7
    other = trained("bfloat16", 3, OPTIMIZERS["adagrad"][0])
    with pytest.raises(ValueError, match=r"the state holds optimizer state \['sum'\], the table's rowwise_adagrad "
                                         r"keeps \['row_sum'\]"):
        a.load_state(other.state())
    wide = trained("float32", 3)
    a.load_state(wide.state())
    assert torch.equal(a.weight, wide.weight.to(torch.bfloat16))
