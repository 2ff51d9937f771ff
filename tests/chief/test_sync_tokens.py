"""training.sync_tokens on the in-process cluster (the push/pull path through the socket data plane
and the actor path): TensorFlow's token queue with fewer replicas than gradients per update (X1)."""

from __future__ import annotations

import pytest

import dtrain
from dtrain.chief.session import Session
from dtrain.deploy.cluster import connect
from tests.helpers.paths import SPECS

SPEC = SPECS / "valid" / "sync_tokens.yaml"


@pytest.mark.parametrize(("transport", "init_tokens", "stale"), [
    ("socket", 2, 0),  # TF's least init tokens (4 - 2): no gradient wasted
    ("dask", 4, 2),  # TF's default (replicas_to_aggregate): two gradients tagged with step 0 arrive late
])
def test_fewer_replicas_than_gradients_per_update_x1(inproc_client, tmp_path, transport, init_tokens, stale):
    spec = dtrain.load(SPEC, overrides=[f"training.transport={transport}", f"training.init_tokens={init_tokens}"])
    t = spec.training
    assert spec.num_replicas() == 2 and t.replicas_to_aggregate == 4
    with connect(spec, client=inproc_client) as conn, conn.client.as_current():
        session = Session(spec, conn, tmp_path / "run")
        result = session.run()
    s = result.summary
    assert s["status"] == "completed"
    assert s["global_step"] == t.steps
    assert s["dropped_stale"] == stale
    # Every update is the mean of 4 gradients: the ps saw 4 per step (plus the stale ones), each of
    # a batch of 16; the 2 replicas computed them all (one or two more were refused after the stop).
    assert s["samples"] == (4 * t.steps + stale) * spec.data.batch_size
    local = {st["replica"]: st["local_steps"] for st in session.replica_stats}
    assert set(local) == {0, 1} and min(local.values()) > 0
    assert 4 * t.steps + stale <= sum(local.values()) <= 4 * t.steps + stale + 2
    # And it trains.
    losses = [r["loss"] for r in session.records if r.get("loss") is not None]
    assert losses[-1] < 0.5 * losses[0]
    assert s["eval"]["accuracy"] >= 0.8
