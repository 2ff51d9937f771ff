"""dtrain on SLURM with dask-jobqueue as it comes: default worker names, automatic assignment,
elastic replicas and adaptive scaling.

An EXAMPLE to adapt, not run by dtrain's test suite (there is no SLURM here; see docs/elastic.md).
Run it on a login node, in the same Python environment as the compute nodes, with dask-jobqueue
installed:

    pip install dask-jobqueue
    python docs/jobqueue/slurm_elastic.py pipelines/digits_elastic.yaml

Unlike slurm_cluster.py, no worker is named or tagged for a task: `cluster.assign: auto` gives the
ps task the first worker and a replica to each of the others. The pipeline's replicas are elastic
(`worker: {min: 1, max: 4}`), and `dtrain.adapt(cluster, spec)` turns on Dask's adaptive scaling
for them (docs/elastic.md): it submits jobs for the ps and one replica, then for the other replica
slots; the run starts as soon as the ps and one replica have a node, takes more replicas as the
queue grants nodes, and goes on when nodes leave (preemption, walltime), with a new job submitted
for each lost one. Idle workers are retired (replicas that finished); the ps's never is.
"""

from __future__ import annotations

import os
import sys

from dask_jobqueue import SLURMCluster
from distributed import Client
from distributed.security import Security

import dtrain

PIPELINE = sys.argv[1] if len(sys.argv) > 1 else "pipelines/digits_elastic.yaml"
spec = dtrain.load(PIPELINE, overrides=["cluster.wait_s=1800"])  # nodes may wait in the queue

os.makedirs(os.path.expanduser("~/.dtrain-jobqueue"), mode=0o700, exist_ok=True)
cluster = SLURMCluster(
    cores=4, memory="16GB", processes=1,         # one Dask worker (one task) per SLURM job
    queue="compute", account="my-project", walltime="04:00:00",
    job_script_prologue=["source ~/venvs/dtrain/bin/activate", "export DASK_DISTRIBUTED__WORKER__DAEMON=False"],
    security=Security.temporary(),               # TLS: see slurm_cluster.py for why
    shared_temp_directory=os.path.expanduser("~/.dtrain-jobqueue"),
    interface="ib0",
    scheduler_options={"dashboard_address": ":8787"},
)
dtrain.adapt(cluster, spec, interval=10.0)        # the ps job + 1 to 4 replica jobs, one per slot with work

with Client(cluster, direct_to_workers=True, security=cluster.security) as client:
    result = dtrain.run(spec, client=client, run_dir=f"runs/{spec.name}")
    s = result.summary
    print(s["status"], s.get("eval"), f"joined {s['replicas_joined']}, left {s['replicas_left']}, "
          f"at most {s['replicas_max']} replicas")
cluster.close()
