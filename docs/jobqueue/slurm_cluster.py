"""dtrain on SLURM with dask-jobqueue: one SLURM job per task, named ps-0, ps-1, worker-0, worker-1.

An EXAMPLE to adapt, not run by dtrain's test suite (there is no SLURM here; see
docs/deployment.md#slurm-dask-jobqueue). Run it on a login node, in the same Python environment
as the compute nodes (a shared file system), with dask-jobqueue installed:

    pip install dask-jobqueue
    python docs/jobqueue/slurm_cluster.py pipelines/digits_async.yaml

The Dask scheduler runs in this process; every task is a SLURM job running one `dask worker`
named ``<job>-<index>`` and tagged with the resource ``<job>=1`` -- exactly what
`dtrain worker --job <job> --task <index>` would start. dtrain then finds each task's worker by
name. The run directory is written here (on the login node's file system).
"""

from __future__ import annotations

import os
import sys

from dask_jobqueue import SLURMCluster
from distributed import Client
from distributed.security import Security

import dtrain

PIPELINE = sys.argv[1] if len(sys.argv) > 1 else "pipelines/digits_async.yaml"

# Per-job SLURM settings: anything SLURMCluster accepts (cores, memory, queue, walltime,
# job_extra_directives, ...). processes=1: one Dask worker -- one task -- per SLURM job.
JOB_OPTIONS = {
    "ps": {"cores": 2, "memory": "8GB"},
    "worker": {"cores": 4, "memory": "16GB", "job_extra_directives": ["--gres=gpu:1"]},
}

# The jobs may wait in the queue: give dtrain time to see every task's worker.
spec = dtrain.load(PIPELINE, overrides=["cluster.wait_s=1800"])

os.makedirs(os.path.expanduser("~/.dtrain-jobqueue"), mode=0o700, exist_ok=True)
cluster = SLURMCluster(
    cores=2, memory="8GB", processes=1,          # defaults; overridden per job below
    queue="compute", account="my-project", walltime="04:00:00",
    job_script_prologue=[
        "source ~/venvs/dtrain/bin/activate",   # the same environment as this process
        "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
    ],
    # The scheduler and the workers bind their node's cluster interface (not every interface), and
    # speak TLS with a certificate made for this run: on a shared cluster any user can reach their
    # ports, and a plain tcp:// scheduler runs anyone's code as you. With Security.temporary()
    # dask-jobqueue writes the run's certificate and key into shared_temp_directory for the jobs
    # (keep it private: chmod 700). With files from examples/make_certs.py use
    # distributed.Security(tls_ca_file=..., ..., require_encryption=True) instead. Either way
    # dtrain's socket data plane is TLS too, with each worker's own certificate (README "Security").
    security=Security.temporary(),
    shared_temp_directory=os.path.expanduser("~/.dtrain-jobqueue"),
    interface="ib0",                             # or "eth0": the nodes' cluster network
    scheduler_options={"dashboard_address": ":8787"},
)

# One worker spec per task. SpecCluster (which SLURMCluster is) passes the spec's key as the
# Dask worker name (`dask worker --name ps-0`); worker_extra_args adds the job's resource.
base = cluster.new_spec["options"]
for job in spec.cluster.jobs:
    for index in range(spec.cluster.num_tasks(job)):
        name = f"{job}-{index}"
        options = {**base, **JOB_OPTIONS.get(job, {}), "job_name": f"dtrain-{name}",
                   "worker_extra_args": [*(base.get("worker_extra_args") or []), "--resources", f"{job}=1"]}
        cluster.worker_spec[name] = {"cls": cluster.job_cls, "options": options}
cluster.scale(jobs=len(cluster.worker_spec))       # submit the SLURM jobs (no new names added)

with Client(cluster, direct_to_workers=True, security=cluster.security) as client:
    result = dtrain.run(spec, client=client, run_dir=f"runs/{spec.name}")
    print(result.summary["status"], result.summary.get("eval"))
cluster.close()                                    # scancel the jobs
