"""A recommender with sparse embedding tables on the parameter servers, from Python.

    python examples/sparse_recommender.py [STEPS]    # or STEPS=..., RUN_DIR=...

``examples.mymodels:CTRNet`` is a plain ``nn.Module`` with two ``sparse=True`` embeddings (a user
table and an item bag) of 100,000 rows each: dtrain keeps both only on the 2 ps tasks, split by
rows (``placement.embedding_partition: mod``), and each replica moves only the rows its batch
touches. It trains on pipelines/data/ctr_sparse.npz (``python -m dtrain.data.ctr``), prints how
the plan placed the tables, and loads the trained ``model.pt`` into ``dtrain.build_model`` for
inference with plain torch. In-process workers (one per task), as in custom_module_and_hook.py.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import dask
import numpy as np
import torch
from distributed import Client, Scheduler, SpecCluster, Worker

import dtrain

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # makes `examples.mymodels` importable, whatever the working directory

STEPS = int(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("STEPS", 60))
RUN_DIR = Path(os.environ.get("RUN_DIR", "runs/example-sparse"))

spec = dtrain.loads(f"""
name: example-sparse
cluster: {{jobs: {{ps: 2, worker: 2}}}}
model: {{module: examples.mymodels:CTRNet, loss: bce_with_logits}}
placement: {{embedding_partition: mod}}
data: {{source: {ROOT / "pipelines" / "data" / "ctr_sparse.npz"}, batch_size: 128}}
optimizer: {{name: adagrad, lr: 0.1}}
training: {{mode: sync, steps: {STEPS}}}
summary: {{every_steps: 20, tensorboard: false}}
""")


def main() -> None:
    logging.getLogger("distributed").setLevel(logging.WARNING)
    plan = dtrain.compile(spec)
    for table in plan.tables:
        parts = ", ".join(f"{p.rows} rows on {p.task}" for p in table.parts)
        print(f"table {table.name}: {table.kind} {table.num_embeddings}x{table.dim} ({parts})")
    workers = {
        f"{job}-{i}": {"cls": Worker, "options": {
            "name": f"{job}-{i}", "resources": {job: 1}, "nthreads": 2, "host": "127.0.0.1", "dashboard": False,
        }}
        for job in spec.cluster.jobs for i in range(spec.cluster.num_tasks(job))
    }
    scheduler = {"cls": Scheduler, "options": {
        "host": "127.0.0.1", "port": 0, "dashboard": False, "dashboard_address": "127.0.0.1:0"}}
    with dask.config.set({"distributed.admin.tick.limit": "60s"}):
        cluster = SpecCluster(workers=workers, scheduler=scheduler, name="example-sparse")
        client = Client(cluster)
        try:
            s = dtrain.run(spec, client=client, run_dir=RUN_DIR).summary
        finally:
            client.close()
            cluster.close()
    print(f"status {s['status']} at global step {s['global_step']}")
    print(f"eval accuracy: {s['eval']['accuracy']:.4f}")
    # Inference with plain torch: model.pt holds both tables whole, as normal state_dict entries.
    model = dtrain.build_model(spec)
    model.load_state_dict(torch.load(RUN_DIR / "model.pt", weights_only=True))
    model.eval()
    ids = torch.from_numpy(np.load(ROOT / "pipelines" / "data" / "ctr_sparse.npz")["x"][:5].astype(np.int64))
    with torch.no_grad():
        clicks = torch.sigmoid(model(ids)).reshape(-1)
    print("click probabilities of the first 5 examples: " + " ".join(f"{p:.3f}" for p in clicks.tolist()))


if __name__ == "__main__":
    main()
