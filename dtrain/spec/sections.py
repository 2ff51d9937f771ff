"""The pipeline's sections besides the model: cluster, placement, optimizer and training (the
data section is in ``data``, the session's sections in ``session``, a graph pipeline's in ``graph``,
the cluster's elastic jobs and adaptive scaling in ``elastic_jobs``). Rules within one section live
here; rules across sections run in ``PipelineSpec`` (``pipeline``), some from modules of their own
that read the sections through ``PipelineView`` (``view``).

Every model is :class:`~dtrain.spec.base.Strict` (``base``): unknown keys are refused (with a "did
you mean"), so are booleans where numbers are expected, and every field has a description
(``dtrain schema``)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import (
    EXECUTABLE_DEVICE_TYPES,
    MAX_BUCKET_MB,
    MAX_SEED,
    MAX_STEPS,
    MAX_TASKS_PER_JOB,
    WEEK_S,
    Strict,
    check_device_string,
    check_device_type,
)
from .device import JOB_NAME_RULE, DeviceSpec
from .elastic_jobs import AdaptiveSpec, ElasticJob, parse_elastic
from .errors import CrossFieldErrors
from .partitioner import PartitionerSpec
from .sizes import memory_limit_bytes

# --------------------------------------------------------------------------------------- cluster


class SecuritySpec(Strict):
    """TLS files for the scheduler connection (maps to ``distributed.Security``)."""

    ca_file: str = Field(description="CA certificate (PEM) that signed the scheduler's and workers' certificates.")
    cert_file: str = Field(description="This client's certificate (PEM).")
    key_file: str | None = Field(None, description="This client's private key (PEM); omit when cert_file holds both.")


class ClusterSpec(Strict):
    """The jobs and tasks of the cluster (TF's ClusterSpec) and where its scheduler is."""

    jobs: dict[str, Annotated[int, Field(ge=1, le=MAX_TASKS_PER_JOB)] | list[str] | ElasticJob] = Field(
        default_factory=lambda: {"ps": 1, "worker": 2},
        description="Job name -> number of tasks, or a list of Dask worker names/addresses, one per task "
        "(like ClusterSpec's host lists), at most 256 tasks per job. Task i of job J is served by the worker named "
        "'J-i'. The embedded cluster (no scheduler) starts one process per task: at most 64 in all. The replicas' "
        "job may be elastic, {min: M, max: N}: workers join and leave a running async job (docs/elastic.md).",
    )
    scheduler: str | None = Field(
        None,
        description="Address of a running Dask scheduler (tcp://host:8786 or tls://...). "
        "Default: an embedded cluster on 127.0.0.1 with one worker process per task.",
    )
    wait_s: float = Field(60.0, gt=0, le=WEEK_S,
                          description="How long to wait for a worker for every task before failing (at most a week).")
    worker_ttl_s: float = Field(
        30.0, gt=0, le=WEEK_S,
        description="Embedded cluster: seconds of silence after which the scheduler drops a worker (at most a week)."
    )
    scheduler_timeout_s: float = Field(
        30.0, gt=0, le=WEEK_S,
        description="Seconds the chief waits for the scheduler's answer to any one question (which workers it "
        "has, checked several times a second) before it fails the run, with its summary: a scheduler that is "
        "stopped, frozen or overloaded (at most a week).")
    lease_s: float | None = Field(
        None, gt=0, le=WEEK_S,
        description="Seconds each ps shard keeps serving without a renewal from the chief (it renews every quarter "
        "lease): after that it stops its replicas and closes its data plane, so the workers of a killed chief "
        "hold nothing. Default (null): max(60, 4 x worker_ttl_s), well past anything a live chief waits for; "
        "a shorter lease frees a dead run's workers sooner but may stop the shards of a chief that is only slow.")
    memory_limit: str = Field(
        "4GiB", description="Embedded cluster: memory limit of each worker process: a size such as 4GiB or 512MB "
        "(units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB; at least 64MiB), 'auto' (Dask's share of the machine) or 0 "
        "(no limit). Refused with cluster.scheduler, dtrain run --scheduler or dtrain.run(client=): that cluster's "
        "workers have their own.")
    nthreads: int = Field(2, ge=1, description="Embedded cluster: threads per worker process (a replica uses one); "
                          "refused on a running cluster, like memory_limit.")
    dashboard: bool = Field(True, description="Embedded cluster: serve the Dask dashboard on 127.0.0.1; refused on a "
                            "running cluster, like memory_limit.")
    start_method: Literal["forkserver", "spawn"] = Field("forkserver", description="Embedded cluster: how worker "
        "processes start: forked from a server with torch and dtrain imported (fast), or spawned fresh (Dask's default); "
        "refused on a running cluster, like memory_limit.")
    security: SecuritySpec | None = Field(None, description="TLS for the scheduler connection.")
    tls: bool = Field(True, description="Embedded cluster: TLS with a per-run certificate on every Dask connection "
                      "and the data plane. false: plain TCP on 127.0.0.1 (faster where the bytes cross the socket; "
                      "anyone on this machine who can reach the ports can then connect to the scheduler).")
    assign: Literal["auto", "named"] = Field(
        "auto", description="Which Dask worker serves each task. named: the worker named J-i (or listed for the "
        "task, or tagged with the resource J), as `dtrain worker` and the embedded cluster start them. auto: the "
        "same when such workers exist; otherwise the tasks go to the cluster's workers as they are (a LocalCluster, "
        "dask-jobqueue, dask-kubernetes): ps tasks first, spread over hosts, then one replica per remaining worker.")
    adaptive: AdaptiveSpec | None = Field(None, description="Embedded cluster: Dask's adaptive scaling of the elastic "
                                          "replicas' workers, {min, max} (docs/elastic.md).")

    @field_validator("jobs", mode="before")
    @classmethod
    def _jobs(cls, jobs: Any) -> Any:
        example = "e.g. jobs: {ps: 1, worker: 2}"
        if not isinstance(jobs, dict):
            raise ValueError(f"expected a mapping of job name -> number of tasks or list of workers, {example}; "
                             f"got {jobs!r}")
        if not jobs:
            raise ValueError(f"at least one job is needed, {example}")
        problems: list[tuple[tuple[str | int, ...], str]] = []
        most = MAX_TASKS_PER_JOB
        for name, tasks in jobs.items():
            if not isinstance(name, str) or not re.fullmatch(JOB_NAME_RULE, name):
                problems.append(((str(name),), f"job name {name!r} must match {JOB_NAME_RULE} (a letter, then "
                                               "letters, digits or '_'), as TensorFlow's servers require"))
            elif isinstance(tasks, dict):  # elastic: {min, max}
                jobs = {**jobs, name: parse_elastic(name, tasks, problems)}
            elif isinstance(tasks, bool) or not isinstance(tasks, (int, list, tuple)):
                problems.append(((name,), f"expected a number of tasks (1..{most}), a list of Dask worker "
                                          f"names/addresses, or {{min: M, max: N}} (elastic), got {tasks!r}"))
            elif isinstance(tasks, int) and not 1 <= tasks <= most:
                problems.append(((name,), f"job {name!r} needs 1..{most} tasks, got {tasks}"))
            elif isinstance(tasks, (list, tuple)) and len(tasks) > most:
                problems.append(((name,), f"job {name!r} lists {len(tasks)} workers; at most {most} tasks per job"))
            elif isinstance(tasks, (list, tuple)) and not tasks:
                problems.append(((name,), f"job {name!r} lists no tasks; list one worker name/address per task"))
            elif isinstance(tasks, (list, tuple)) and not all(isinstance(t, str) and t for t in tasks):
                problems.append(((name,), f"job {name!r}: every task must be a worker name or address "
                                          f"(a non-empty string), got {tasks!r}"))
        if problems:
            raise CrossFieldErrors(problems)
        return jobs

    @field_validator("memory_limit")
    @classmethod
    def _memory_limit(cls, v: str) -> str:
        memory_limit_bytes(v)  # ValueError naming the forms accepted
        return v

    def num_tasks(self, job: str) -> int:
        """Tasks of ``job`` (an elastic job's slots: its ``max``)."""
        tasks = self.jobs.get(job, 0)
        if isinstance(tasks, ElasticJob):
            return tasks.max
        return len(tasks) if isinstance(tasks, list) else int(tasks)

    def task_workers(self, job: str) -> list[str]:
        """The Dask worker name (or address) expected to serve each task of ``job``."""
        tasks = self.jobs.get(job, 0)
        if isinstance(tasks, list):
            return list(tasks)
        return [f"{job}-{i}" for i in range(self.num_tasks(job))]


# ------------------------------------------------------------------------------------- placement


class PlacementSpec(Strict):
    """Where variables and compute live (replica_device_setter and tf.device)."""

    variables: Literal["round_robin", "greedy", "partitioned"] = Field(
        "round_robin",
        description="How variables are spread over ps tasks: round_robin in creation order (replica_device_setter's "
        "default), greedy by bytes (GreedyLoadBalancingStrategy), or partitioned (large variables split along dim 0).",
    )
    ps_job: str = Field("ps", description="The job whose tasks hold variables.")
    worker_job: str = Field("worker", description="The job whose tasks run replicas.")
    worker_device: str = Field(
        "cpu", description="Device replicas compute on: cpu, cuda, cuda:N, or a device string such as /gpu:0."
    )
    soft: bool = Field(True, description="Fall back to CPU with a warning when the placed GPU is absent.")
    variable_devices: dict[str, str] = Field(
        default_factory=dict,
        description="Pin variables by name (torch's named_parameters() name, or a prefix ending in '.') to a device, "
        "e.g. {'0.weight': /job:ps/task:1}. Pinned to a ps task: it keeps its task and still advances round robin. "
        "Variables live in their task's CPU memory: a GPU device type is refused.",
    )
    min_slice_bytes: int = Field(
        256 * 1024, ge=1, description="partitioned: variables of at least this many bytes are split over ps tasks."
    )
    partitioner: PartitionerSpec | None = Field(
        None, description="Split variables into parts (TensorFlow's partitioners: fixed_size, min_max, "
        "variable_axis_size), each part placed like a variable by `variables` (round_robin or greedy).",
    )
    layer_devices: dict[str, str] = Field(
        default_factory=dict,
        description="model.module: pin the module's top-level children (by name, or a prefix ending in '.') to "
        "devices, e.g. {encoder: /job:worker/task:0, head: /job:worker/task:1}; the children then run in order, "
        "like nn.Sequential, as pipeline stages (docs/pipeline.md). For model.layers use each layer's device.",
    )
    embedding_partition: Literal["mod", "div"] = Field(
        "mod", description="How sparse embedding tables are split by rows over the ps tasks (TensorFlow's "
        "partition_strategy): mod puts id i on task i % P, div gives each task a contiguous range.",
    )

    @model_validator(mode="after")
    def _partitioner_alone(self) -> PlacementSpec:
        if self.partitioner is not None and self.variables == "partitioned":
            raise CrossFieldErrors([(("variables",), "'partitioned' splits by min_slice_bytes and cannot be combined "
                                     "with placement.partitioner: set variables to round_robin or greedy (how the "
                                     "parts are placed), or remove the partitioner")])
        if self.partitioner is not None and "min_slice_bytes" in self.model_fields_set:
            raise CrossFieldErrors([(("min_slice_bytes",), "applies to variables: partitioned only; with "
                                     "placement.partitioner use its own size key (min_slice_size, max_shard_bytes)")])
        return self

    @field_validator("worker_device")
    @classmethod
    def _worker_device(cls, v: str) -> str:
        worker_device_spec(v)
        return v

    @field_validator("variable_devices", "layer_devices")
    @classmethod
    def _var_devices(cls, v: dict[str, str]) -> dict[str, str]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name, dev in v.items():
            try:
                check_device_string(dev)
            except ValueError as exc:
                problems.append(((name,), str(exc)))
        if problems:
            raise CrossFieldErrors(problems)
        return v


def worker_device_spec(value: str) -> DeviceSpec:
    """``cpu`` / ``cuda`` / ``cuda:1`` / ``/gpu:0`` -> a DeviceSpec with only the device fields set."""
    v = value.strip()
    m = re.fullmatch(r"(cpu|cuda|gpu)(?::(\d+))?", v, flags=re.IGNORECASE)
    if m:
        kind = "CPU" if m.group(1).lower() == "cpu" else "GPU"
        return DeviceSpec(device_type=kind, device_index=int(m.group(2) or 0))
    if v.startswith("/"):
        spec = DeviceSpec.from_string(v)
        if spec.device_type is None:
            raise ValueError(f"{value!r} names no device; write cpu, cuda, cuda:N or /gpu:N")
        if spec.job is not None or spec.replica is not None or spec.task is not None:
            if spec.device_type in EXECUTABLE_DEVICE_TYPES:
                fix = repr(DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string())
            else:  # both wrong: say so at once
                fix = f"/device:CPU:0 or /device:GPU:N (device type {spec.device_type!r} does not exist here)"
            raise ValueError(f"{value!r} names a job or task: worker_device takes only the device part (replica r "
                             f"always runs on worker task r); write {fix}")
        check_device_type(spec, value)
        return spec
    raise ValueError(f"{value!r} is not a device; write cpu, cuda, cuda:N or a device string like /gpu:0")


# ------------------------------------------------------------------------------------------ data

# ------------------------------------------------------------------------------------- optimizer


class _Opt(Strict):
    lr: float = Field(0.01, gt=0.0, description="Learning rate (finite, > 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 penalty, as torch applies it (finite, >= 0).")


class SgdOptimizer(_Opt):
    name: Literal["sgd"] = Field(description="Plain SGD (torch.optim.SGD).")


class MomentumOptimizer(_Opt):
    name: Literal["momentum"] = Field(description="SGD with momentum (torch.optim.SGD(momentum=...)).")
    momentum: float = Field(0.9, gt=0.0, lt=1.0, description="Momentum factor.")
    nesterov: bool = Field(False, description="Nesterov momentum.")
    dampening: float = Field(0.0, ge=0.0, lt=1.0, description="Dampening for momentum.")


_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class AdamOptimizer(_Opt):
    name: Literal["adam"] = Field(description="Adam (torch.optim.Adam).")
    lr: float = Field(0.001, gt=0.0, description="Learning rate (finite, > 0).")
    betas: tuple[_Beta, _Beta] = Field(
        (0.9, 0.999), description="Coefficients for the running averages, each in [0, 1) (as torch.optim.Adam).")
    eps: float = Field(1e-8, gt=0.0, description="Term added to the denominator (finite, > 0).")
    amsgrad: bool = Field(False, description="AMSGrad variant.")


class AdagradOptimizer(_Opt):
    name: Literal["adagrad"] = Field(description="Adagrad (torch.optim.Adagrad).")
    lr_decay: float = Field(0.0, ge=0.0, description="Learning-rate decay.")
    initial_accumulator_value: float = Field(0.0, ge=0.0, description="Starting value of the accumulators.")
    eps: float = Field(1e-10, gt=0.0, description="Term added to the denominator.")


OptimizerSpec = Annotated[
    SgdOptimizer | MomentumOptimizer | AdamOptimizer | AdagradOptimizer, Field(discriminator="name")
]


# -------------------------------------------------------------------------------------- training


class MovingAverageSpec(Strict):
    """tf.train.ExponentialMovingAverage as SyncReplicasOptimizer's variable_averages (dtrain.ps.averages)."""

    decay: float = Field(ge=0.0, lt=1.0, description="After every applied update: shadow = decay * shadow + "
                         "(1 - decay) * variable, for every dense variable, kept on its ps task; in [0, 1), e.g. 0.999.")
    num_updates: bool = Field(False, description="TF's num_updates=global_step: decay at step n is min(decay, "
                              "(1 + n) / (10 + n)), so the average follows the variables closely early on.")
    use_for_eval: bool = Field(True, description="Evaluate (eval.every_steps and the final evaluation) and write "
                               "model.pt with the averages instead of the trained variables.")


class TrainingSpec(Strict):
    """Replication and the step protocol."""

    replication: Literal["between_graph", "in_graph"] = Field(
        "between_graph",
        description="between_graph: each replica runs its own loop and shares only the ps; in_graph: the session "
        "decides every step and the towers run it: sync on the socket data plane drives one tower actor per worker "
        "task (no Dask task per step); otherwise one Dask graph per step (N gradient tasks, a reduce, an apply; with "
        "mode: async, one graph per tower step, each tower's gradient applied on arrival).",
    )
    mode: Literal["async", "sync"] = Field(
        "async", description="async: each push is applied at once; sync: SyncReplicasOptimizer semantics."
    )
    replicas_to_aggregate: Annotated[int, Field(ge=1)] | Annotated[float, Field(gt=0, le=1)] | Literal["all"] | None \
        = Field(None, description="sync: gradients averaged per update: a count, a fraction of the replicas "
                "(0.75: three quarters, rounded up; with elastic replicas, of the live ones) or all (the default).")
    total_num_replicas: int | None = Field(
        None, ge=1, description="Replicas, backups included (default and maximum: the worker job's task count)."
    )
    sync_tokens: bool = Field(
        False, description="sync: TensorFlow's token queue instead of dtrain's step barrier: a replica tags its "
        "gradient with its local step, then takes a token (the global step it computes on next; it waits only "
        "while none is left); an update applies replicas_to_aggregate fresh gradients from any replicas and "
        "enqueues max(total_num_replicas, replicas_to_aggregate) tokens; replicas_to_aggregate may exceed the "
        "replicas. One ps task, between_graph (docs/tokens.md).")
    init_tokens: int | None = Field(
        None, ge=0, description="sync_tokens: tokens of the global step enqueued at start and after a restore "
        "(TF's num_tokens); default replicas_to_aggregate; at least replicas_to_aggregate - total_num_replicas.")
    steps: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="The last global step (at most 2**62). Default: 1000, or unbounded "
        "when data.epochs is set (the data's end ends training).")
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="Seed for initialisation, data order and dropout (0 .. 2**32 - 1).")
    overlap: bool | None = Field(
        None, description="async: overlap the push/pull round trip with the next step's compute (each replica's "
        "gradient is one step stale). Default (unset): on in async between_graph mode unless max_staleness or "
        "sparse tables rule it out; false: a replica waits for its push's reply (one replica is then exact SGD).")
    max_staleness: int | None = Field(
        None, ge=0, le=MAX_STEPS, description="async: bounded staleness k (stale synchronous parallel). Default: unbounded."
    )
    barrier_timeout_s: float = Field(
        60.0, gt=0, le=WEEK_S, description="sync: how long a replica waits for the others (at most a week).")
    call_timeout_s: float = Field(
        60.0, gt=0, le=WEEK_S, description="Timeout of every call a replica makes to a ps task (at most a week).")
    stage_start_timeout_s: float = Field(
        1800.0, gt=0, le=WEEK_S, description="Pipeline stages: how long a stage waits for the first message from "
        "each neighbour, which comes once that neighbour has started (built its layers, read its first batch, "
        "made its first pull) and so have the stages beyond it; later messages wait call_timeout_s + "
        "barrier_timeout_s. A neighbour whose process ends fails the wait at once, one whose machine is lost "
        "within about 2 minutes (TCP keepalive). Never less than call_timeout_s + barrier_timeout_s; at most a week.")
    max_recoveries: int = Field(3, ge=0, description="Lost ps/worker recoveries before the run fails.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per replica process.")
    transport: Literal["dask", "socket"] = Field(
        "socket",
        description="Data plane for the flat parameter/gradient buffers: socket (one persistent TCP connection per "
        "replica and shard, opened by the ps actor, authenticated with a per-run secret, TLS when the cluster "
        "uses TLS) or dask (ps actor method calls). Dask is the control plane either way.",
    )
    wire_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of parameters and gradients on the wire: bfloat16 halves the bytes moved "
        "(transport: socket only; the ps keeps and applies float32).")
    bucket_mb: float = Field(
        1.0, ge=0, le=MAX_BUCKET_MB, description="transport: socket without shared memory: send the gradient in buckets of about "
        "this many MB while backward is still running, last layers first (DDP's gradient bucketing); the push "
        "after backward sends only the rest. 0 sends it whole after backward (as does training.microbatches > 1: "
        "a bucket would hold a part of the batch). At most 1024.")
    microbatches: int = Field(
        1, ge=1, le=4096, description="Split each replica's batch into this many micro-batches (GPipe): pipeline "
        "stages work on different micro-batches at once; their gradients add up to the whole batch's. With one "
        "stage, gradient accumulation (the update equals the whole batch's; no gradient buckets during backward). "
        "At most data.batch_size.")
    pin_cpus: bool = Field(
        False, description="Pin each replica's compute thread to torch_threads CPUs of its machine, the replicas "
        "of one machine spread over its CPUs in index order (Linux; the ps threads are not pinned).")
    moving_average: MovingAverageSpec | None = Field(
        None, description="Keep exponential moving averages of the variables on the ps (TF's variable_averages); "
        "default: none.")
    shared_memory: bool = Field(
        True, description="transport: socket: when a replica and its ps run on the same machine, keep the "
        "buffers in shared memory (/dev/shm, unlinked once both map it) and send only headers over the socket; "
        "falls back to the socket per connection when the ps cannot map the file (another machine or container, "
        "a full /dev/shm). In sync mode without backup replicas the replicas also read the ps's parameters in "
        "place (a read-only mapping of its memory: no snapshot per reply).")

    def overlaps(self, tables: bool = False) -> bool:
        """Whether a between_graph replica overlaps its push with its next step: ``overlap`` when set,
        else on in async mode unless ``max_staleness`` or sparse tables (``tables``) rule it out."""
        if self.overlap is not None:
            return self.overlap
        return self.mode == "async" and self.replication == "between_graph" and self.max_staleness is None \
            and not tables
