"""Incremental checkpoint parts (ps/deltas.py, ``ParameterShard.write_part``/``load_part``), on a
shard of its own: a full part, then a delta of the rows written since, restore bit for bit what a
full part of the same moment holds, on the shard (``load_part``) and merged as states (the chief's
and the export's path); fixed tables alone and grouped, rows drawn on first use, bfloat16 storage
and a table without a vocabulary with evictions; a delta holds only the changed rows; a shard asked
for a delta of a checkpoint it does not count from writes a full part."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dtrain.ps.deltas import is_delta, merge
from dtrain.ps.part_writer import read_part_file
from dtrain.ps.shard import ParameterShard

D = 4


def tables() -> list[dict[str, Any]]:
    fixed = {"num_embeddings": 1000, "dim": D, "num_parts": 2, "part": 0, "strategy": "mod", "init_std": 0.5,
             "seed": 3, "storage": "float32", "optimizer": None}
    return [
        {**fixed, "name": "a.weight"},  # a and b batch in one group (same dim, storage, optimizer)
        {**fixed, "name": "b.weight", "init": "per_id"},
        {**fixed, "name": "c.weight", "storage": "bfloat16", "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}},
        {"name": "d.weight", "dim": D, "num_parts": 2, "part": 0, "strategy": "hash", "init_std": 0.5, "seed": 3,
         "storage": "float32", "optimizer": None,
         "dynamic": {"max_rows": 64, "min_count": 1, "ttl_steps": 6, "policy": "lru"}},
    ]


def shard(incremental: bool = True) -> ParameterShard:
    config = {"index": 0, "mode": "async", "steps": 1000, "num_replicas": 1, "optimizer": {"name": "adagrad",
              "lr": 0.1}, "barrier_timeout_s": 5, "tables": tables(), "incremental": incremental}
    return ParameterShard(config, torch.zeros(6))


def mine(name: str, ids: np.ndarray) -> torch.Tensor:
    from dtrain.model.ids import home_part

    t = torch.from_numpy(ids)
    if name == "d.weight":
        return torch.unique(t[home_part(t, 2) == 0])
    return torch.unique(t[(t % 2 == 0) & (t < 1000)])


async def steps(s: ParameterShard, rng: np.random.Generator, n: int, hot: int) -> None:
    """``n`` async pushes, each touching a few ids among ``hot`` (Zipf-like: small ids most)."""
    for _ in range(n):
        sparse = {}
        for name in ("a.weight", "b.weight", "c.weight", "d.weight"):
            scale = 7 if name == "d.weight" else 2
            ids = mine(name, (rng.zipf(1.3, 12) % hot * scale).astype(np.int64))
            looked = mine(name, (rng.zipf(1.3, 12) % hot * scale).astype(np.int64))  # (read, maybe not updated)
            sparse[name] = (ids, torch.from_numpy(rng.normal(size=(len(ids), D)).astype(np.float32)), looked)
        await s.pull(sparse={k: (None, None, v[0]) for k, v in sparse.items()})  # (admits the dynamic ids)
        await s.push_pull(torch.from_numpy(rng.normal(size=6).astype(np.float32)), 0, s.step, sparse=sparse)
        assert s.error is None, s.error


def write(s: ParameterShard, directory: Path, tag: int, since: int | None) -> dict[str, Any]:
    async def go():
        started = await s.write_part(str(directory), "shard-00000.pt", tag, since)
        assert "error" not in started, started
        return await s.part_written(wait=True)

    done = asyncio.run(go())
    assert "error" not in done, done
    return {"path": str(directory / done["file"]), "bytes": done["bytes"], "sha256": done["sha256"], **done}


def contents(s: ParameterShard) -> dict[str, Any]:
    """Everything a checkpoint restores, comparable: dense state, and per table its rows (a dynamic
    table's by id) with optimizer state, step count and (per_id) which rows are drawn."""
    state = asyncio.run(s.get_state(tables=False))
    out = {"params": state["params"], "step": state["step"], "opt": state["optimizer_state"]}
    for name, part in s.tables.items():
        if name == "d.weight":
            live = part.chunk(0, len(part.ids))
            order = torch.argsort(live["ids"])
            out[name] = {k: live[k][order] for k in ("ids", "weight", "last", "freq")}
            out[name].update({f"opt.{k}": v[order] for k, v in live["optimizer"].items() if torch.is_tensor(v)})
            out[name].update(clock=live["clock"], counters=live["counters"], step=part.optimizer.step_count)
        else:
            weight = part.weight.clone()
            if part._fresh is not None:
                weight[part._fresh] = 0  # (rows not drawn yet: their stored values mean nothing)
            out[name] = {"weight": weight, "step": part.optimizer.step_count,
                         **{f"opt.{k}": v.clone() for k, v in part.optimizer.tensors().items()},
                         "fresh": None if part._fresh is None else part._fresh.clone()}
    return out


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A shard trained 30 pushes (full part at tag 10 after 10, deltas at 20 and 30), and a full
    part at 30 written from the same state as the delta at 30."""
    root = tmp_path_factory.mktemp("deltas")
    s, rng = shard(), np.random.default_rng(0)
    asyncio.run(steps(s, rng, 10, hot=300))
    full10 = write(s, root / "10", 10, None)
    asyncio.run(steps(s, rng, 10, hot=300))
    delta20 = write(s, root / "20", 20, 10)
    asyncio.run(steps(s, rng, 10, hot=40))  # (few rows: the evictions of d's ttl come in this stretch)
    delta30 = write(s, root / "30", 30, 20)
    full30 = write(s, root / "30full", 30, None)
    return s, [full10, delta20, delta30], full30


def test_a_shard_writes_a_delta_only_of_the_checkpoint_it_counts_from(written):
    s, (full10, delta20, delta30), full30 = written
    assert (full10["kind"], delta20["kind"], delta30["kind"], full30["kind"]) == ("full", "delta", "delta", "full")
    assert delta20["base"] == 10 and delta30["base"] == 20
    other = shard()
    asyncio.run(steps(other, np.random.default_rng(1), 2, hot=50))
    root = Path(full10["path"]).parent.parent
    assert write(other, root / "x", 5, 3)["kind"] == "full"  # (it never wrote 3: a delta would miss rows)
    assert write(other, root / "y", 6, 5)["kind"] == "delta"
    plain = shard(incremental=False)  # (changes not tracked: every part whole)
    assert write(plain, root / "z", 1, None)["kind"] == write(plain, root / "z2", 2, 1)["kind"] == "full"


def test_a_delta_holds_only_the_rows_written_since_its_base(written):
    s, (_full10, delta20, delta30), full30 = written
    late = read_part_file(delta30["path"], delta30["bytes"], delta30["sha256"])
    whole = read_part_file(full30["path"], full30["bytes"], full30["sha256"])
    assert is_delta(late) and not is_delta(whole)
    rows = late["tables"]["a.weight"]["rows"]
    assert 0 < len(rows) <= 60  # the last 10 pushes touched at most 20 ids of 40 hot ones per table
    assert torch.equal(late["tables"]["a.weight"]["weight"], whole["tables"]["a.weight"]["weight"][rows])
    assert len(late["tables"]["d.weight"]["evicted"]) > 0  # ttl 6: rows of the first 20 pushes went
    assert delta30["bytes"] < full30["bytes"] / 3


def test_full_and_deltas_restore_what_a_full_part_of_the_same_moment_holds(written):
    s, chain, full30 = written
    expected = contents(s)
    a, b = shard(), shard()
    assert asyncio.run(a.load_part([(c["path"], c["bytes"], c["sha256"]) for c in chain], 30)) == 30
    assert asyncio.run(b.load_part([(full30["path"], full30["bytes"], full30["sha256"])], 30)) == 30
    assert_same(contents(a), expected)
    assert_same(contents(b), expected)
    assert a.checkpoint_base == 30  # (its next part may be a delta of the checkpoint restored)


def test_merged_states_equal_the_full_part(written):
    _s, chain, full30 = written
    parts = [read_part_file(c["path"], c["bytes"], c["sha256"]) for c in chain]
    state = parts[0]
    for delta in parts[1:]:
        state = merge(state, delta)
    whole = read_part_file(full30["path"], full30["bytes"], full30["sha256"])
    x, y = shard(), shard()
    asyncio.run(x.set_state(state))
    asyncio.run(y.set_state(whole))
    assert_same(contents(x), contents(y))


def test_a_chain_must_start_with_a_full_part(written):
    from dtrain.ps.part_writer import BadPartError

    _s, (_full10, delta20, _delta30), _ = written
    with pytest.raises(BadPartError, match="a delta where its chain needs a full part"):
        asyncio.run(shard().load_part([(delta20["path"], delta20["bytes"], delta20["sha256"])], 20))
