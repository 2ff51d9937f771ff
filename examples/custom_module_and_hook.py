"""A custom ``nn.Module`` and a custom hook, both named by import path (examples/mymodels.py).

    python examples/custom_module_and_hook.py [MAX_STEPS]    # or STEPS=..., THRESHOLD=..., RUN_DIR=...

The hook stops the run early, with ``ctx.request_stop``, once the training loss falls below
``THRESHOLD`` (0.3), long before ``training.steps`` (``STEPS``, 3000). The pipeline is YAML text
read with ``dtrain.loads``. The cluster is a ``distributed.SpecCluster`` of in-process workers
(one per task, named ``<job>-<index>``): they share this process's ``sys.path``, so
``examples.mymodels`` needs no installing. With worker processes (``Nanny``, ``dtrain worker``),
the module must be importable on every worker too (``pip install`` it, or ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import dask
from distributed import Client, Scheduler, SpecCluster, Worker

import dtrain

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # makes `examples.mymodels` importable, whatever the working directory

STEPS = int(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("STEPS", 3000))
THRESHOLD = float(os.environ.get("THRESHOLD", 0.3))
RUN_DIR = Path(os.environ.get("RUN_DIR", "runs/example-custom"))

spec = dtrain.loads(f"""
name: example-custom
cluster: {{jobs: {{ps: 1, worker: 2}}}}
model:
  module: examples.mymodels:Net          # package.module:Name, imported by dtrain
  kwargs: {{hidden: 48}}                  # passed to Net(...)
  loss: cross_entropy
data: {{source: sklearn:digits, batch_size: 32}}
optimizer: {{name: sgd, lr: 0.05}}
training: {{mode: async, steps: {STEPS}}}
summary: {{every_steps: 20, tensorboard: false}}   # the loss the hook sees is refreshed every 20 steps
hooks:
  - {{type: "examples.mymodels:StopBelowLoss", args: {{threshold: {THRESHOLD}}}}}
""")


def main() -> None:
    logging.getLogger("distributed").setLevel(logging.WARNING)
    workers = {
        f"{job}-{i}": {"cls": Worker, "options": {
            "name": f"{job}-{i}", "resources": {job: 1}, "nthreads": 2, "host": "127.0.0.1", "dashboard": False,
        }}
        for job in spec.cluster.jobs for i in range(spec.cluster.num_tasks(job))
    }
    scheduler = {"cls": Scheduler, "options": {
        "host": "127.0.0.1", "port": 0, "dashboard": False, "dashboard_address": "127.0.0.1:0"}}
    # Replicas are long tasks on purpose: do not warn that they block the (shared) event loop.
    with dask.config.set({"distributed.admin.tick.limit": "60s"}):
        cluster = SpecCluster(workers=workers, scheduler=scheduler, name="example-custom")
        client = Client(cluster)
        try:
            s = dtrain.run(spec, client=client, run_dir=RUN_DIR).summary
        finally:
            client.close()
            cluster.close()
    record = json.loads((RUN_DIR / "stop_below_loss.json").read_text())
    print(f"status {s['status']}: stopped at global step {s['global_step']} of {spec.training.steps}")
    print(f"the hook saw {len(record['seen'])} losses and asked to stop at step {record['stopped_at']}")
    print(f"eval accuracy: {s['eval']['accuracy']:.4f}")


if __name__ == "__main__":
    main()
