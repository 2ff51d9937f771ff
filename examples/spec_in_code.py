"""A pipeline built in code and run on a Dask cluster this script starts itself.

    python examples/spec_in_code.py [STEPS]        # or STEPS=200 python examples/spec_in_code.py

dtrain needs one Dask worker per task, named ``<job>-<index>`` (``ps-0``, ``worker-0``,
``worker-1``) or tagged with the resource ``<job>=1``. ``distributed.LocalCluster`` cannot name
heterogeneous workers, so this builds a ``distributed.SpecCluster`` with one worker process
(a ``Nanny``) per task, all bound to 127.0.0.1, and hands its client to ``dtrain.run``.
Writes ``runs/example-spec-in-code/`` (or ``RUN_DIR``).
"""

from __future__ import annotations

import logging
import os
import sys

from distributed import Client, Nanny, Scheduler, SpecCluster

import dtrain

STEPS = int(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("STEPS", 600))
RUN_DIR = os.environ.get("RUN_DIR", "runs/example-spec-in-code")

# The same keys as a pipeline YAML file, as Python data; validated (strictly) right here.
spec = dtrain.PipelineSpec.model_validate({
    "name": "example-spec-in-code",
    "cluster": {"jobs": {"ps": 1, "worker": 2}},          # /job:ps/task:0, /job:worker/task:0..1
    "model": {
        "input_shape": [64],                               # digits: 8x8 images, flattened
        "layers": [{"type": "linear", "out": 64}, {"type": "relu"}, {"type": "linear", "out": 10}],
        "loss": "cross_entropy",
    },
    "data": {"source": "sklearn:digits", "batch_size": 32},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "training": {"mode": "async", "steps": STEPS, "seed": 0},
    "summary": {"every_steps": 50, "tensorboard": False},
})


def main() -> None:
    logging.getLogger("distributed").setLevel(logging.WARNING)  # this process's (the scheduler's)
    # One worker process per task: named <job>-<index> and tagged with the resource <job>=1.
    workers = {
        f"{job}-{i}": {"cls": Nanny, "options": {
            "name": f"{job}-{i}", "resources": {job: 1}, "nthreads": 2, "host": "127.0.0.1",
            "dashboard_address": None, "memory_limit": "2GiB",
            "silence_logs": logging.WARNING,               # the worker processes' Dask logs
        }}
        for job in spec.cluster.jobs for i in range(spec.cluster.num_tasks(job))
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard_address": "127.0.0.1:0"}}
    cluster = SpecCluster(workers=workers, scheduler=scheduler, name="example")
    client = Client(cluster)
    try:
        print("dashboard:", client.dashboard_link)
        print("workers:", sorted(w["name"] for w in client.scheduler_info()["workers"].values()))
        result = dtrain.run(spec, client=client, run_dir=RUN_DIR)
        s = result.summary
        print(f"status {s['status']}: {s['global_step']} steps, final loss {s['final_loss']:.4f}")
        print(f"eval accuracy: {s['eval']['accuracy']:.4f}")
        print(f"run directory: {result.run_dir}")
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":  # needed: the worker processes are spawned and re-import this file
    main()
