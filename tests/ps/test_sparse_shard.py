"""ParameterShard with sparse table parts, on its own event loop (as on a ps worker): rows ride on
the pushes and their replies, the sync quorum applies the mean of the row gradients, an id the
data checks never saw fails the run naming table and id, and the rows survive get/set_state."""

from __future__ import annotations

import asyncio

import torch

from dtrain.model.tables import init_rows
from dtrain.ps.rows import TablePart
from dtrain.ps.shard import ParameterShard

N, D = 20, 3


def shard(mode: str = "sync", part: int = 0, lr: float = 1.0) -> ParameterShard:
    table = {"name": "0.weight", "num_embeddings": N, "dim": D, "num_parts": 2, "part": part, "strategy": "mod",
             "init_std": 1.0, "seed": 4}
    config = {"index": part, "mode": mode, "steps": 100, "num_replicas": 2, "replicas_to_aggregate": 2,
              "optimizer": {"name": "sgd", "lr": lr}, "barrier_timeout_s": 5, "tables": [table]}
    return ParameterShard(config, torch.zeros(2))


def initial(ids: list[int]) -> torch.Tensor:
    return init_rows(4, "0.weight", N, D, 1.0, torch.tensor(ids))


def test_sync_quorum_applies_the_mean_of_the_row_gradients_and_replies_with_the_next_rows():
    async def main():
        s = shard()
        a = s.push_sync(torch.ones(2), 0, 0, sparse={"0.weight": (torch.tensor([2, 4]), torch.ones(2, D),
                                                                   torch.tensor([4, 6]))})
        b = s.push_sync(torch.ones(2), 1, 0, sparse={"0.weight": (torch.tensor([4]), torch.full((1, D), 3.0),
                                                                   torch.tensor([0]))})
        return await asyncio.gather(a, b), s

    ((pa, step_a, _, _, rows_a), (_, step_b, _, _, rows_b)), s = asyncio.run(main())
    assert step_a == step_b == 1 and torch.equal(pa, -torch.ones(2))
    # id 2: (1 + 0) / 2; id 4: (1 + 3) / 2; lr 1
    expected = initial([4, 6]) - torch.stack([torch.full((D,), 2.0), torch.zeros(D)])
    assert torch.allclose(rows_a["0.weight"], expected)
    assert torch.allclose(rows_b["0.weight"], initial([0]))
    assert torch.allclose(s.tables["0.weight"].gather(torch.tensor([2])), initial([2]) - 0.5)


def test_an_id_outside_the_table_fails_the_run_and_changes_nothing():
    async def main():
        s = shard(mode="async")
        before = s.tables["0.weight"].weight.clone()
        reply = await s.push_pull(torch.ones(2), 0, 0, sparse={"0.weight": (torch.tensor([2, 40]),
                                                                            torch.ones(2, D), torch.tensor([2]))})
        stats = await s.stats()
        after_error = await s.push_pull(torch.ones(2), 1, 0, sparse={"0.weight": (torch.tensor([2]),
                                                                                  torch.ones(1, D), None)})
        return s, before, reply, stats, after_error

    s, before, reply, stats, after_error = asyncio.run(main())
    assert stats["error"] == "replica 0: id 40 is outside table 0.weight (num_embeddings 20, ids 0..19)"
    assert reply[4] == {} and after_error[4] == {}  # no rows served once the run has failed
    assert torch.equal(s.tables["0.weight"].weight, before) and torch.equal(s.param, torch.zeros(2))
    odd = shard(mode="async")  # an id of the other ps task's part (mod: odd ids live on part 1)
    asyncio.run(odd.pull(sparse={"0.weight": (None, None, torch.tensor([3]))}))
    assert "id 3 is not on ps part 0 of table 0.weight" in asyncio.run(odd.stats())["error"]


def test_tables_travel_in_the_state_and_are_restored():
    async def main():
        s = shard(mode="async", lr=0.5)
        await s.push_pull(torch.ones(2), 0, 0, sparse={"0.weight": (torch.tensor([8]), torch.ones(1, D), None)})
        state = await s.get_state()
        await s.push_pull(torch.ones(2), 0, 1, sparse={"0.weight": (torch.tensor([8]), torch.ones(1, D), None)})
        fresh = shard(mode="async", lr=0.5)
        assert await fresh.set_state(state) == 1
        return state, fresh

    state, fresh = asyncio.run(main())
    row = initial([8]) - 0.5
    assert torch.allclose(state["tables"]["0.weight"]["weight"][4], row[0])  # taken before the second step
    assert torch.allclose(fresh.tables["0.weight"].gather(torch.tensor([8])), row)
    assert fresh.tables["0.weight"].optimizer.step_count == 1


def test_tables_that_batch_serve_their_rows_through_one_group():
    """Three tables with one layout and optimizer share a group (ps/groups.py): the quorum's step,
    the replies and a bad id's message are those of the tables alone."""
    names = ("a.weight", "b.weight", "c.weight")
    tables = [{"name": n, "num_embeddings": N + k, "dim": D, "num_parts": 2, "part": 0, "strategy": "mod",
               "init_std": 1.0, "seed": 4} for k, n in enumerate(names)]
    config = {"index": 0, "mode": "sync", "steps": 100, "num_replicas": 2, "replicas_to_aggregate": 2,
              "optimizer": {"name": "adagrad", "lr": 0.5}, "barrier_timeout_s": 5, "tables": tables}
    alone = {t["name"]: TablePart(**t, optimizer_config=config["optimizer"]) for t in tables}
    pushes = [{"a.weight": (torch.tensor([2, 4]), torch.ones(2, D), torch.tensor([4, 6])),
               "c.weight": (torch.tensor([0, 20]), torch.full((2, D), 2.0), torch.tensor([], dtype=torch.int64))},
              {"a.weight": (torch.tensor([4]), torch.full((1, D), 3.0), torch.tensor([0])),
               "b.weight": (torch.tensor([8]), torch.ones(1, D), torch.tensor([8, 10]))}]

    async def main():
        s = ParameterShard(config, torch.zeros(2))
        replies = await asyncio.gather(*(s.push_sync(torch.ones(2), r, 0, sparse=p) for r, p in enumerate(pushes)))
        bad = await s.pull(sparse={"b.weight": (None, None, torch.tensor([21]))})
        return s, replies, bad, await s.stats()

    s, replies, bad, stats = asyncio.run(main())
    assert [g.names for g in s.tables.groups] == [list(names)]
    for push in pushes:
        for name, (ids, grads, _) in push.items():
            alone[name].add_grad(ids, grads)
    for part in alone.values():
        part.apply(0.5)
    for push, reply in zip(pushes, replies, strict=True):
        assert reply[4].keys() == push.keys()
        for name, (_, _, pull) in push.items():
            assert torch.equal(reply[4][name], alone[name].gather(pull))
    for name in names:
        assert torch.equal(s.tables[name].weight, alone[name].weight)
        assert s.tables[name].optimizer.step_count == 1
    assert bad[4] == {} and stats["error"] == "replica -1: id 21 is outside table b.weight (num_embeddings 21, ids 0..20)"
