"""The pipeline file as strict pydantic models.

Every model forbids unknown keys and documents every field (the descriptions become
``dtrain schema``'s help). Rules that span sections live in ``PipelineSpec``'s after-validator
and report every problem at once, each with its own dotted path (``CrossFieldErrors``), so
the loader can print one ``FILE:LINE: path: message`` line per problem.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .device import DeviceSpec
from .errors import CrossFieldErrors

_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=False)

    # pydantic's lax mode reads True as 1; in YAML `steps: yes` is a boolean, never a count.
    # (A model-level check, because pydantic refuses before-validators on discriminator fields.)
    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            problems: list[tuple[tuple[str | int, ...], str]] = []
            for key, value in data.items():
                if isinstance(value, bool) and key in cls.model_fields:
                    kinds = _scalar_kinds(cls.model_fields[key].annotation)
                    if bool not in kinds and kinds & {int, float}:
                        what = "an integer" if float not in kinds else "a number"
                        problems.append(((key,), f"expected {what}, got {value!r} "
                                                 "(YAML reads yes/no/on/off/true/false as booleans)"))
            if problems:
                raise CrossFieldErrors(problems)
        return data


def _scalar_kinds(annotation: Any) -> set[Any]:
    """The plain types a field accepts directly (through Optional/Union/Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _scalar_kinds(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        out: set[Any] = set()
        for arg in typing.get_args(annotation):
            out |= _scalar_kinds(arg)
        return out
    return {annotation} if origin is None else set()


def did_you_mean(value: Any, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""``."""
    hint = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {hint[0]!r}?" if hint else ""


def _quoted(choices: typing.Iterable[str]) -> str:
    return ", ".join(repr(c) for c in choices)


def _check_device_string(value: str | None) -> str | None:
    if value is None:
        return None
    DeviceSpec.from_string(value)  # raises ValueError with the grammar
    return value


# --------------------------------------------------------------------------------------- cluster


class SecuritySpec(_Strict):
    """TLS files for the scheduler connection (maps to ``distributed.Security``)."""

    ca_file: str = Field(description="CA certificate (PEM) that signed the scheduler's and workers' certificates.")
    cert_file: str = Field(description="This client's certificate (PEM).")
    key_file: str | None = Field(None, description="This client's private key (PEM); omit when cert_file holds both.")


class ClusterSpec(_Strict):
    """The jobs and tasks of the cluster (TF's ClusterSpec) and where its scheduler is."""

    jobs: dict[str, Annotated[int, Field(ge=1, le=256)] | list[str]] = Field(
        default_factory=lambda: {"ps": 1, "worker": 2},
        description="Job name -> number of tasks, or a list of Dask worker names/addresses, one per task "
        "(like ClusterSpec's host lists). Task i of job J is served by the worker named 'J-i'.",
    )
    scheduler: str | None = Field(
        None,
        description="Address of a running Dask scheduler (tcp://host:8786 or tls://...). "
        "Default: an embedded cluster on 127.0.0.1 with one worker process per task.",
    )
    wait_s: float = Field(60.0, gt=0, description="How long to wait for a worker for every task before failing.")
    worker_ttl_s: float = Field(
        30.0, gt=0, description="Embedded cluster: seconds of silence after which the scheduler drops a worker."
    )
    memory_limit: str = Field("4GiB", description="Embedded cluster: memory limit of each worker process.")
    nthreads: int = Field(2, ge=1, description="Embedded cluster: threads per worker process (a replica uses one).")
    dashboard: bool = Field(True, description="Embedded cluster: serve the Dask dashboard on 127.0.0.1.")
    security: SecuritySpec | None = Field(None, description="TLS for the scheduler connection.")

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
        for name, tasks in jobs.items():
            if not isinstance(name, str) or not re.match(_NAME, name):
                problems.append(((str(name),), f"job name {name!r} must be letters, digits, '_', '.', '-'"))
            elif isinstance(tasks, bool) or not isinstance(tasks, (int, list, tuple)):
                problems.append(((name,), f"expected a number of tasks (1..256) or a list of Dask worker "
                                          f"names/addresses, got {tasks!r}"))
            elif isinstance(tasks, int) and not 1 <= tasks <= 256:
                problems.append(((name,), f"job {name!r} needs 1..256 tasks, got {tasks}"))
            elif isinstance(tasks, (list, tuple)) and not tasks:
                problems.append(((name,), f"job {name!r} lists no tasks; list one worker name/address per task"))
            elif isinstance(tasks, (list, tuple)) and not all(isinstance(t, str) and t for t in tasks):
                problems.append(((name,), f"job {name!r}: every task must be a worker name or address "
                                          f"(a non-empty string), got {tasks!r}"))
        if problems:
            raise CrossFieldErrors(problems)
        return jobs

    def num_tasks(self, job: str) -> int:
        tasks = self.jobs.get(job, 0)
        return len(tasks) if isinstance(tasks, list) else int(tasks)

    def task_workers(self, job: str) -> list[str]:
        """The Dask worker name (or address) expected to serve each task of ``job``."""
        tasks = self.jobs.get(job, 0)
        if isinstance(tasks, list):
            return list(tasks)
        return [f"{job}-{i}" for i in range(int(tasks))]


# ----------------------------------------------------------------------------------------- model


class _Layer(_Strict):
    name: str | None = Field(None, description="Optional label shown by `dtrain plan`.")
    device: str | None = Field(
        None, description="Device of this layer's compute, e.g. /job:worker/task:1 or /gpu:0 (merged with the replica's)."
    )

    _device = field_validator("device")(classmethod(lambda cls, v: _check_device_string(v)))

    def params(self) -> dict[str, Any]:
        return self.model_dump(exclude={"name", "device"})


class LinearLayer(_Layer):
    type: Literal["linear"] = Field(description="Fully connected layer on the last dimension.")
    out: int = Field(ge=1, description="Output features.")
    bias: bool = Field(True, description="Learn an additive bias.")


class ActivationLayer(_Layer):
    type: Literal["relu", "tanh", "gelu", "sigmoid", "silu", "elu", "identity"] = Field(
        description="Elementwise activation."
    )


class LeakyReluLayer(_Layer):
    type: Literal["leaky_relu"] = Field(description="Leaky ReLU.")
    negative_slope: float = Field(0.01, description="Slope for negative inputs.")


class DropoutLayer(_Layer):
    type: Literal["dropout"] = Field(description="Dropout (active in training only).")
    p: float = Field(0.5, ge=0.0, lt=1.0, description="Probability of zeroing an element.")


class FlattenLayer(_Layer):
    type: Literal["flatten"] = Field(description="Flatten every non-batch dimension.")


class ReshapeLayer(_Layer):
    type: Literal["reshape"] = Field(description="Reshape the non-batch dimensions.")
    shape: list[int] = Field(min_length=1, description="New non-batch shape, e.g. [1, 8, 8].")


class Conv2dLayer(_Layer):
    type: Literal["conv2d"] = Field(description="2-D convolution over (C, H, W) inputs.")
    out: int = Field(ge=1, description="Output channels.")
    kernel_size: int = Field(ge=1, description="Square kernel size.")
    stride: int = Field(1, ge=1, description="Stride.")
    padding: int = Field(0, ge=0, description="Zero padding on each side.")
    bias: bool = Field(True, description="Learn an additive bias.")


class Pool2dLayer(_Layer):
    type: Literal["max_pool2d", "avg_pool2d"] = Field(description="2-D pooling over (C, H, W) inputs.")
    kernel_size: int = Field(ge=1, description="Square window size.")
    stride: int | None = Field(None, ge=1, description="Stride (default: kernel_size).")


class NormLayer(_Layer):
    type: Literal["batch_norm1d", "layer_norm"] = Field(description="Normalisation over features.")


Layer = Annotated[
    LinearLayer | ActivationLayer | LeakyReluLayer | DropoutLayer | FlattenLayer | ReshapeLayer
    | Conv2dLayer | Pool2dLayer | NormLayer,
    Field(discriminator="type"),
]

LAYER_NAMES = (
    "linear", "relu", "tanh", "gelu", "sigmoid", "silu", "elu", "identity", "leaky_relu", "dropout", "flatten",
    "reshape", "conv2d", "max_pool2d", "avg_pool2d", "batch_norm1d", "layer_norm",
)


class ModelSpec(_Strict):
    """The model: a stack of layers, or a torch.nn.Module factory by import path."""

    input_shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Shape of one example without the batch dimension, e.g. [64] or [1, 28, 28]."
    )
    layers: list[Layer] | None = Field(None, description="Layers applied in order (see the README for each type).")
    module: str | None = Field(
        None, description="Import path of an nn.Module class or factory, 'package.module:Name' (instead of layers)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for `module`.")
    loss: Literal["cross_entropy", "mse", "bce_with_logits"] = Field(
        "cross_entropy", description="Training loss; cross_entropy makes it a classification task."
    )

    @field_validator("module")
    @classmethod
    def _module_path(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$", v):
            raise ValueError(f"{v!r} is not an import path; write 'package.module:Name' (a module importable on "
                             "every worker, and an nn.Module class or factory in it)")
        return v

    @model_validator(mode="after")
    def _layers_or_module(self) -> ModelSpec:
        if self.layers is not None and self.module is not None:
            raise CrossFieldErrors([(("module",), "give either 'layers' (with 'input_shape') or 'module', not both; "
                                                  "remove one of them")])
        if self.layers is None and self.module is None:
            raise CrossFieldErrors([((), "the model needs 'layers' (with 'input_shape'), e.g. input_shape: [64] and "
                                         "layers: [{type: linear, out: 10}], or 'module: package.module:Name'")])
        if self.layers is not None and self.input_shape is None:
            raise CrossFieldErrors([(("input_shape",), "'layers' needs 'input_shape', the shape of one example "
                                                       "without the batch dimension, e.g. input_shape: [64]")])
        if self.layers is not None and not self.layers:
            raise CrossFieldErrors([(("layers",), "'layers' is empty; list at least one layer, "
                                                  "e.g. - {type: linear, out: 10}")])
        if self.input_shape is not None and not self.input_shape:
            raise CrossFieldErrors([(("input_shape",), "'input_shape' is empty; give the shape of one example, "
                                                       "e.g. [64] or [1, 28, 28]")])
        return self


# ------------------------------------------------------------------------------------- placement


class PlacementSpec(_Strict):
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
        "e.g. {'0.weight': /job:ps/task:1}. Pinned to a ps task: it keeps its task and still advances round robin.",
    )
    min_slice_bytes: int = Field(
        256 * 1024, ge=1, description="partitioned: variables of at least this many bytes are split over ps tasks."
    )

    @field_validator("worker_device")
    @classmethod
    def _worker_device(cls, v: str) -> str:
        worker_device_spec(v)
        return v

    @field_validator("variable_devices")
    @classmethod
    def _var_devices(cls, v: dict[str, str]) -> dict[str, str]:
        for dev in v.values():
            _check_device_string(dev)
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
        return spec
    raise ValueError(f"{value!r} is not a device; write cpu, cuda, cuda:N or a device string like /gpu:0")


# ------------------------------------------------------------------------------------------ data


class DataSpec(_Strict):
    """Training data: a synthetic problem, a bundled scikit-learn dataset, or a file."""

    source: str = Field(
        "synthetic",
        description="synthetic | sklearn:digits (also sklearn:iris, sklearn:wine, sklearn:breast_cancer, "
        "sklearn:diabetes) | path to .npz/.csv/.parquet, relative to the pipeline file.",
    )
    batch_size: int = Field(32, ge=1, description="Examples per replica per step.")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Share held out for evaluation (seeded, stratified).")
    standardize: bool = Field(True, description="Scale features with the training split's mean and std.")
    target: str = Field("label", description="Target column of .csv/.parquet files.")
    task: Literal["classification", "regression"] | None = Field(
        None, description="synthetic only: the kind of problem (default: from the loss)."
    )
    num_samples: int = Field(4096, ge=8, description="synthetic only: number of examples.")
    num_classes: int = Field(10, ge=2, description="synthetic classification only: number of classes.")
    shuffle: bool = Field(True, description="Reshuffle every epoch (seeded).")


# ------------------------------------------------------------------------------------- optimizer


class _Opt(_Strict):
    lr: float = Field(0.01, gt=0.0, description="Learning rate (> 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 penalty, as torch applies it.")


class SgdOptimizer(_Opt):
    name: Literal["sgd"] = Field(description="Plain SGD (torch.optim.SGD).")


class MomentumOptimizer(_Opt):
    name: Literal["momentum"] = Field(description="SGD with momentum (torch.optim.SGD(momentum=...)).")
    momentum: float = Field(0.9, gt=0.0, lt=1.0, description="Momentum factor.")
    nesterov: bool = Field(False, description="Nesterov momentum.")
    dampening: float = Field(0.0, ge=0.0, lt=1.0, description="Dampening for momentum.")


class AdamOptimizer(_Opt):
    name: Literal["adam"] = Field(description="Adam (torch.optim.Adam).")
    lr: float = Field(0.001, gt=0.0, description="Learning rate (> 0).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Coefficients for the running averages.")
    eps: float = Field(1e-8, gt=0.0, description="Term added to the denominator.")
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


class TrainingSpec(_Strict):
    """Replication and the step protocol."""

    replication: Literal["between_graph", "in_graph"] = Field(
        "between_graph",
        description="between_graph: each replica runs its own loop and shares only the ps; in_graph: the session "
        "submits one Dask graph per step (N gradient tasks, a reduce, an apply). in_graph needs mode: sync.",
    )
    mode: Literal["async", "sync"] = Field(
        "async", description="async: each push is applied at once; sync: SyncReplicasOptimizer semantics."
    )
    replicas_to_aggregate: int | None = Field(
        None, ge=1, description="sync: gradients averaged per update (default: all replicas)."
    )
    total_num_replicas: int | None = Field(
        None, ge=1, description="Replicas, backups included (default and maximum: the worker job's task count)."
    )
    steps: int = Field(1000, ge=1, description="The last global step.")
    seed: int = Field(0, ge=0, description="Seed for initialisation, data order and dropout.")
    overlap: bool = Field(
        False, description="async: overlap the push/pull round trip with the next step's compute (staleness 1)."
    )
    max_staleness: int | None = Field(
        None, ge=0, description="async: bounded staleness k (stale synchronous parallel). Default: unbounded."
    )
    barrier_timeout_s: float = Field(60.0, gt=0, description="sync: how long a replica waits for the others.")
    call_timeout_s: float = Field(60.0, gt=0, description="Timeout of every call a replica makes to a ps task.")
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
        1.0, ge=0, description="transport: socket without shared memory: send the gradient in buckets of about "
        "this many MB while backward is still running, last layers first (DDP's gradient bucketing); the push "
        "after backward sends only the rest. 0 sends it whole after backward.")
    pin_cpus: bool = Field(
        False, description="Pin each replica's compute thread to torch_threads CPUs of its machine, the replicas "
        "of one machine spread over its CPUs in index order (Linux; the ps threads are not pinned).")
    shared_memory: bool = Field(
        True, description="transport: socket: when a replica and its ps run on the same machine, keep the "
        "buffers in shared memory (/dev/shm, unlinked once both map it) and send only headers over the socket; "
        "falls back to the socket per connection when the ps cannot map the file (another machine or container, "
        "a full /dev/shm).")


# ------------------------------------------------------------------------ checkpoint/summary/eval


class CheckpointSpec(_Strict):
    """CheckpointSaverHook: atomic checkpoints of every shard at one consistent step."""

    every_steps: int | None = Field(None, ge=1, description="Save every N global steps.")
    every_secs: float | None = Field(None, gt=0, description="Save every N seconds.")
    keep: int = Field(3, ge=1, description="Keep the newest N checkpoints.")

    @model_validator(mode="after")
    def _when(self) -> CheckpointSpec:
        if self.every_steps is None and self.every_secs is None:
            self.every_steps = 500
        return self


class SummarySpec(_Strict):
    """SummarySaverHook: metrics.jsonl and TensorBoard events."""

    every_steps: int = Field(100, ge=1, description="Write a summary every N global steps.")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files under tb/.")


class EvalSpec(_Strict):
    """Evaluation on the test split."""

    every_steps: int | None = Field(None, ge=1, description="Evaluate every N global steps (always at the end).")


class HookSpec(_Strict):
    """A hook: logging | nan_guard | step_counter | stop_at_step, or a custom one by import path."""

    type: str = Field(description="logging | nan_guard | step_counter | stop_at_step | 'package.module:HookClass'.")
    every_steps: int | None = Field(None, ge=1, description="logging/step_counter: every N global steps.")
    every_secs: float | None = Field(None, gt=0, description="logging/step_counter: every N seconds.")
    num_steps: int | None = Field(None, ge=1, description="stop_at_step: stop after N more steps.")
    last_step: int | None = Field(None, ge=1, description="stop_at_step: stop at this global step.")
    args: dict[str, Any] = Field(default_factory=dict, description="Custom hooks: keyword arguments of the class.")

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in BUILTIN_HOOKS and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", v):
            raise ValueError(f"unknown hook {v!r}{did_you_mean(v, BUILTIN_HOOKS)} "
                             f"(built-in: {_quoted(BUILTIN_HOOKS)}; or a custom one as 'package.module:HookClass')")
        return v

    @model_validator(mode="after")
    def _known(self) -> HookSpec:
        if self.type == "stop_at_step" and (self.num_steps is None) == (self.last_step is None):
            raise CrossFieldErrors([((), "stop_at_step needs exactly one of num_steps or last_step, "
                                         "e.g. {type: stop_at_step, num_steps: 100}")])
        if self.type in BUILTIN_HOOKS and self.args:
            raise CrossFieldErrors([(("args",), f"'args' is for custom hooks; {self.type} takes "
                                                "every_steps/every_secs/num_steps/last_step")])
        return self


BUILTIN_HOOKS = ("logging", "nan_guard", "step_counter", "stop_at_step")


# ----------------------------------------------------------------------------------------- graph


class VariableSpec(_Strict):
    """A variable of a graph section (a tensor held by a ps task)."""

    name: str = Field(pattern=_NAME, description="Name used by graph inputs and fetch.")
    value: float | list[Any] = Field(description="Initial value: a number or a nested list.")
    device: str | None = Field(None, description="Where it lives, e.g. /job:ps/task:0 (default: ps round robin).")

    _device = field_validator("device")(classmethod(lambda cls, v: _check_device_string(v)))


GRAPH_OPS = ("add", "sub", "mul", "div", "matmul", "neg", "identity", "sum", "mean", "square", "sqrt", "relu",
             "exp", "maximum", "minimum", "pow")


class OpSpec(_Strict):
    """An operation of a graph section, evaluated as one Dask task on its device."""

    name: str = Field(pattern=_NAME, description="Name used by later inputs and fetch.")
    op: Literal[GRAPH_OPS] = Field(description="Operation: " + ", ".join(GRAPH_OPS) + ".")  # type: ignore[valid-type]
    inputs: list[str | float] = Field(default_factory=list, description="Variable/op names, or number literals.")
    device: str | None = Field(None, description="Where it runs, e.g. /job:worker/task:1 (default: worker task 0).")

    _device = field_validator("device")(classmethod(lambda cls, v: _check_device_string(v)))


_ARITY = {"add": 2, "sub": 2, "mul": 2, "div": 2, "matmul": 2, "maximum": 2, "minimum": 2, "pow": 2}


# ---------------------------------------------------------------------------------------- pipeline


class PipelineSpec(_Strict):
    """A dtrain pipeline: a training job (model, data, optimizer, training) or a graph (variables, graph, fetch)."""

    name: str = Field("dtrain", pattern=_NAME, description="Run name; the default run directory is runs/<name>/.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Jobs, tasks and the scheduler.")
    model: ModelSpec | None = Field(None, description="The model to train.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Variable and compute placement.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training and test data.")
    optimizer: OptimizerSpec = Field(
        default_factory=lambda: SgdOptimizer(name="sgd"), description="Optimizer applied on the ps (torch semantics)."
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Replication and steps.")
    checkpoint: CheckpointSpec | None = Field(None, description="Checkpoints (none when absent).")
    summary: SummarySpec = Field(default_factory=SummarySpec, description="Summaries (metrics.jsonl, tb/).")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Evaluation on the test split (always at the end).")
    hooks: list[HookSpec] = Field(default_factory=list, description="Extra hooks.")
    variables: list[VariableSpec] = Field(default_factory=list, description="Graph section: variables.")
    graph: list[OpSpec] = Field(default_factory=list, description="Graph section: operations.")
    fetch: list[str] = Field(default_factory=list, description="Graph section: names whose values are printed.")

    # ---- derived, used by the compiler and runtime
    @property
    def is_graph(self) -> bool:
        return self.model is None

    @property
    def base_dir(self) -> Path:
        return Path(self.__pydantic_private__.get("_base_dir", ".") if self.__pydantic_private__ else ".")

    def num_replicas(self) -> int:
        return self.training.total_num_replicas or self.cluster.num_tasks(self.placement.worker_job)

    def replicas_to_aggregate(self) -> int:
        return self.training.replicas_to_aggregate or self.num_replicas()

    def pipeline_hash(self) -> str:
        """sha256 of the canonical JSON of the spec (stored beside checkpoints)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> PipelineSpec:
        base_dir = Path((info.context or {}).get("base_dir", "."))
        object.__setattr__(self, "__pydantic_private__", {"_base_dir": str(base_dir)})
        problems: list[tuple[tuple[str | int, ...], str]] = []
        jobs = self.cluster.jobs
        job_list = ", ".join(f"{j} ({self.cluster.num_tasks(j)} task(s))" for j in jobs)

        def check_device(loc: tuple[str | int, ...], value: str | None) -> None:
            if value is None:
                return
            dev = DeviceSpec.from_string(value)
            if dev.job is not None and dev.job not in jobs:
                problems.append((loc, f"{value!r} names job {dev.job!r}, which the cluster lacks; jobs: {job_list}"))
            elif dev.job is not None and dev.task is not None and dev.task >= self.cluster.num_tasks(dev.job):
                n = self.cluster.num_tasks(dev.job)
                problems.append((loc, f"{value!r} names task {dev.task} but job {dev.job!r} has {n} task(s) "
                                      f"(0..{n - 1}); add tasks in cluster.jobs or pick an existing one"))
            elif dev.job is None and dev.task is not None:
                problems.append((loc, f"{value!r} names a task without a job; write /job:NAME/task:{dev.task}"))

        if self.is_graph:
            if not self.graph and not self.variables:
                problems.append(((), "the pipeline has neither a 'model' nor a 'graph'/'variables' section; "
                                     "add model: {input_shape: [...], layers: [...]} or a graph"))
            self._check_graph(problems, check_device)
            if problems:
                raise CrossFieldErrors(problems)
            return self

        graph_keys = [k for k in ("variables", "graph", "fetch") if getattr(self, k)]
        if graph_keys:
            problems.append(((graph_keys[0],), "a pipeline has either a 'model' or a graph section "
                             "(variables/graph/fetch), not both; split them into two files"))
        for key in ("ps_job", "worker_job"):
            job = getattr(self.placement, key)
            if job not in jobs:
                problems.append((("placement", key) if key in self.placement.model_fields_set else ("cluster", "jobs"),
                                 f"job {job!r} is missing from cluster.jobs (has {job_list}); "
                                 f"add it, e.g. jobs: {{{self.placement.ps_job}: 1, {self.placement.worker_job}: 2}}"))
        workers = self.cluster.num_tasks(self.placement.worker_job)
        t = self.training
        if t.total_num_replicas is not None and workers and t.total_num_replicas > workers:
            problems.append((("training", "total_num_replicas"),
                             f"{t.total_num_replicas} replicas but job {self.placement.worker_job!r} has {workers} "
                             f"task(s); one replica runs per worker task: add worker tasks"))
        elif t.replicas_to_aggregate is not None and workers and t.replicas_to_aggregate > self.num_replicas():
            source = ("training.total_num_replicas" if t.total_num_replicas is not None
                      else f"the {workers} task(s) of job {self.placement.worker_job!r}")
            problems.append((("training", "replicas_to_aggregate"),
                             f"{t.replicas_to_aggregate} exceeds the {self.num_replicas()} replicas ({source}); "
                             f"lower it or add worker tasks"))
        if t.wire_dtype != "float32" and (t.transport != "socket" or t.replication == "in_graph"):
            problems.append((("training", "wire_dtype"), f"wire_dtype {t.wire_dtype} needs transport: socket "
                             "and between_graph replication (Dask's serializer has no bfloat16)"))
        if t.replication == "in_graph" and t.mode == "async":
            problems.append((("training", "replication"),
                             "in_graph replication needs mode: sync (the session aggregates every step); "
                             "set training.mode: sync or use replication: between_graph"))
        if t.mode == "sync" and (t.overlap or t.max_staleness is not None):
            key = "overlap" if t.overlap else "max_staleness"
            problems.append((("training", key), f"{key} applies to mode: async only; remove it or set mode: async"))
        if t.replicas_to_aggregate is not None and t.mode == "async":
            problems.append((("training", "replicas_to_aggregate"),
                             "replicas_to_aggregate applies to mode: sync only; remove it or set mode: sync"))
        check_device(("placement", "worker_device"), self.placement.worker_device
                     if self.placement.worker_device.startswith("/") else None)
        for name, dev in self.placement.variable_devices.items():
            check_device(("placement", "variable_devices", name), dev)

        model = self.model
        assert model is not None
        if model.layers is not None:
            for i, layer in enumerate(model.layers):
                check_device(("model", "layers", i, "device"), layer.device)
            self._check_shapes(problems)
        self._check_data(problems, base_dir)
        if problems:
            raise CrossFieldErrors(problems)
        return self

    def _check_data(self, problems: list[tuple[tuple[str | int, ...], str]], base_dir: Path) -> None:
        from dtrain.data.sources import FILE_SUFFIXES, SKLEARN_DATASETS, data_source_kind, resolve_data_path

        assert self.model is not None
        loss, data = self.model.loss, self.data
        if loss == "cross_entropy" and data.task == "regression":
            problems.append((("data", "task"), "regression data needs loss: mse (cross_entropy is for classes)"))
        source = data.source
        kind = data_source_kind(source)
        if kind == "sklearn":
            name = source.split(":", 1)[1]
            if name not in SKLEARN_DATASETS:
                known = [f"sklearn:{n}" for n in SKLEARN_DATASETS]
                problems.append((("data", "source"), f"unknown scikit-learn dataset {source!r}"
                                 f"{did_you_mean(source, known)} (bundled: {', '.join(known)})"))
            elif name == "diabetes" and loss == "cross_entropy":
                problems.append((("data", "source"), "sklearn:diabetes is a regression dataset; "
                                 "set model.loss: mse"))
        elif kind == "file":
            path = resolve_data_path(source, base_dir)
            assert path is not None
            if path.suffix.lower() not in FILE_SUFFIXES:
                problems.append((("data", "source"), f"{source!r} is not a data source; write 'synthetic', "
                                 f"'sklearn:<name>' ({', '.join(SKLEARN_DATASETS)}) or the path of a "
                                 f"{'/'.join(FILE_SUFFIXES)} file" + did_you_mean(source, ["synthetic"])))
            elif not path.is_file():
                problems.append((("data", "source"), f"data file {source!r} does not exist (looked for {path}; "
                                 "relative paths are relative to the pipeline file's directory)"))

    def _check_shapes(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        from dtrain.model.layers import LayerError, LayerShapeError, infer_shapes

        model = self.model
        assert model is not None and model.layers is not None and model.input_shape is not None
        try:
            shapes = infer_shapes(tuple(model.input_shape), [layer.model_dump() for layer in model.layers])
        except LayerShapeError as exc:
            problems.append((("model", "layers", exc.index), str(exc)))
            return
        except LayerError as exc:  # a parameter the builder rejects (the spec should have caught it)
            problems.append((("model", "layers", exc.index), str(exc)))
            return
        except ValueError as exc:
            problems.append((("model", "input_shape"), str(exc)))
            return
        out = shapes[-1] if shapes else tuple(model.input_shape)
        if model.loss == "cross_entropy" and len(out) != 1:
            problems.append((("model", "layers"), f"cross_entropy needs logits of shape (classes,), the layers "
                             f"produce {out}; end with a linear layer (add a flatten before it)"))

    def _check_graph(self, problems: list, check_device: Any) -> None:
        seen: dict[str, tuple[str | int, ...]] = {}
        for i, var in enumerate(self.variables):
            if var.name in seen:
                problems.append((("variables", i, "name"), f"duplicate name {var.name!r} "
                                 f"(first at {'.'.join(map(str, seen[var.name]))})"))
            seen.setdefault(var.name, ("variables", i))
            check_device(("variables", i, "device"), var.device)
        for i, op in enumerate(self.graph):
            if op.name in seen:
                problems.append((("graph", i, "name"), f"duplicate name {op.name!r} "
                                 f"(first at {'.'.join(map(str, seen[op.name]))})"))
            for j, inp in enumerate(op.inputs):
                if isinstance(inp, str) and inp not in seen:
                    problems.append((("graph", i, "inputs", j), f"{inp!r} is not a variable or an earlier op; "
                                     f"known: {', '.join(seen) or 'none'}"))
                if isinstance(inp, float) and not math.isfinite(inp):
                    problems.append((("graph", i, "inputs", j), "literal must be finite"))
            want = _ARITY.get(op.op, 1)
            if len(op.inputs) != want:
                problems.append((("graph", i, "inputs"), f"op {op.op!r} takes {want} input(s), got {len(op.inputs)}"))
            seen.setdefault(op.name, ("graph", i))
            check_device(("graph", i, "device"), op.device)
        for i, name in enumerate(self.fetch):
            if name not in seen:
                problems.append((("fetch", i), f"{name!r} is not a variable or op; known: {', '.join(seen) or 'none'}"))
