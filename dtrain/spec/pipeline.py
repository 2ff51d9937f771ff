"""The pipeline file as strict pydantic models: ``PipelineSpec``, assembled from the section models.

Every model forbids unknown keys and documents every field (the descriptions become
``dtrain schema``'s help). Rules that span sections run in ``PipelineSpec``'s after-validator
and report every problem at once, each with its own dotted path (``CrossFieldErrors``), so
the loader can print one ``FILE:LINE: path: message`` line per problem.

The rules kept in their own modules sit below this one, with the section models, and never
import it: ``elastic``, ``stages`` and ``tokens`` read a ``PipelineView`` (``view``), the
protocol of the sections they need, which ``PipelineSpec`` is; ``graph``'s rules take the
graph section's lists and the job names. The section models (``sections``, ``elastic_jobs``,
``layers``, ``data``, ``session``, ``graph``, ...) import no rule over the whole spec.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pydantic import BaseModel, Field, ValidationInfo, model_validator

from .base import MAX_EMBEDDED_TASKS, MAX_STEPS, NAME, Strict, did_you_mean
from .data import STREAM_KEYS, DataSpec
from .device import DeviceSpec, is_clear
from .elastic import check_elastic, elastic_of
from .errors import CrossFieldErrors
from .graph import OpSpec, VariableSpec, graph_problems
from .imports import missing_module
from .layers import TABLE_LAYERS, EmbeddingLayer, ModelSpec
from .observe import ObserveSpec
from .sections import ClusterSpec, OptimizerSpec, PlacementSpec, SgdOptimizer, TrainingSpec
from .session import BUILTIN_HOOKS, CheckpointSpec, EvalSpec, HookSpec, SummarySpec
from .stages import stage_problems, stage_tasks
from .tokens import check_tokens

# ---------------------------------------------------------------------------------------- pipeline


class PipelineSpec(Strict):
    """A dtrain pipeline: a training job (model, data, optimizer, training) or a graph (variables, graph, fetch)."""

    name: str = Field("dtrain", pattern=NAME, description="Run name; the default run directory is runs/<name>/.")
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
    observe: ObserveSpec = Field(default_factory=ObserveSpec, description="Telemetry and diagnosis: where time, "
                                 "bytes and staleness go per replica and per ps shard (docs/observability.md); between_graph "
                                 "replication only (refused in_graph and in a graph pipeline).")
    variables: list[VariableSpec] = Field(default_factory=list, description="Graph section: variables.")
    graph: list[OpSpec] = Field(default_factory=list, description="Graph section: operations.")
    fetch: list[str] = Field(default_factory=list, description="Graph section: names whose values are printed.")

    # ---- derived, used by the compiler and runtime
    def last_step(self) -> int:
        """``training.steps``, which validation fills in (1000, or unbounded with ``data.epochs``)."""
        assert self.training.steps is not None, "an unvalidated spec"
        return self.training.steps

    def required_model(self) -> ModelSpec:
        """``model``, which a training pipeline has (a graph pipeline, none: asking is a bug)."""
        assert self.model is not None, "a graph pipeline has no model"
        return self.model

    @property
    def is_graph(self) -> bool:
        return self.model is None

    @property
    def base_dir(self) -> Path:
        return Path(self.__pydantic_private__.get("_base_dir", ".") if self.__pydantic_private__ else ".")

    def num_replicas(self) -> int:
        """Replicas: one per worker task, or per group of stage tasks for a pipeline (spec/stages.py)."""
        workers = self.cluster.num_tasks(self.placement.worker_job)
        stages = stage_tasks(self) if self.model is not None else 1
        if stages > 1:
            return max(1, workers // stages)
        return self.training.total_num_replicas or workers

    def replicas_to_aggregate(self) -> int:
        """Gradients per sync update, of all the replicas (a fraction rounded up)."""
        fraction = self.aggregate_fraction()
        if fraction is None:
            return int(self.training.replicas_to_aggregate)  # type: ignore[arg-type]
        return max(1, math.ceil(fraction * self.num_replicas() - 1e-9))

    def aggregate_fraction(self) -> float | None:
        """``replicas_to_aggregate`` as a share of the replicas (``all``, or unset: 1.0); None for a count."""
        v = self.training.replicas_to_aggregate
        return 1.0 if v is None or v == "all" else (float(v) if isinstance(v, float) else None)

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

        def check_device(loc: tuple[str | int, ...], value: str | None, scope_job: str) -> None:
            """A pin's job must exist and its task be one of that job's; a pin without a job (/task:1) is
            relative, like a nested tf.device: its task is one of ``scope_job``'s, the enclosing scope's job."""
            if value is None or is_clear(value):
                return
            dev = DeviceSpec.from_string(value)
            job = dev.job if dev.job is not None else scope_job
            if dev.job is not None and dev.job not in jobs:
                problems.append((loc, f"{value!r} names job {dev.job!r}, which the cluster lacks; jobs: {job_list}"))
            elif job in jobs and dev.task is not None and dev.task >= self.cluster.num_tasks(job):
                n = self.cluster.num_tasks(job)
                rel = "" if dev.job is not None else f" (a pin without a job is in the enclosing scope's job, {job!r})"
                problems.append((loc, f"{value!r} names task {dev.task} but job {job!r} has {n} task(s) "
                                      f"(0..{n - 1}){rel}; add tasks in cluster.jobs or pick an existing one"))

        # One process per task on this machine, unless the tasks are served by a running cluster
        # (cluster.scheduler, or the scheduler `dtrain run --scheduler` passes in the context).
        total = sum(self.cluster.num_tasks(j) for j in jobs)
        if self.cluster.scheduler is None and not (info.context or {}).get("scheduler") and total > MAX_EMBEDDED_TASKS:
            problems.append((("cluster", "jobs"), f"the embedded cluster would start {total} worker processes, one "
                             f"per task ({job_list}); at most {MAX_EMBEDDED_TASKS} run on one machine: lower the "
                             "task counts, or run on a Dask cluster with cluster.scheduler (or dtrain run --scheduler)"))
        check_elastic(self, problems)
        check_tokens(self, problems)
        problems.extend(embedded_only_problems(self, (info.context or {}).get("scheduler")))
        problems.extend(observe_problems(self))

        if self.is_graph:
            if not self.graph and not self.variables:
                problems.append(((), "the pipeline has neither a 'model' nor a 'graph'/'variables' section; "
                                     "add model: {input_shape: [...], layers: [...]} or a graph"))
            problems.extend(graph_problems(self.variables, self.graph, self.fetch, jobs=list(jobs),
                                           ps_job=self.placement.ps_job, worker_job=self.placement.worker_job,
                                           check_device=check_device))
            if self.training.moving_average is not None:
                problems.append((("training", "moving_average"), "moving averages follow the optimizer's updates on "
                                 "the ps; a graph pipeline has none: remove it (or use a model pipeline)"))
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
        elif isinstance(t.replicas_to_aggregate, int) and workers and t.replicas_to_aggregate > self.num_replicas() \
                and not t.sync_tokens:  # tokens: a replica may push several gradients to one update (X1)
            source = ("training.total_num_replicas" if t.total_num_replicas is not None
                      else f"the {workers} task(s) of job {self.placement.worker_job!r}")
            problems.append((("training", "replicas_to_aggregate"),
                             f"{t.replicas_to_aggregate} exceeds the {self.num_replicas()} replicas ({source}); "
                             f"lower it, add worker tasks, or set training.sync_tokens: true (TensorFlow's token "
                             "queue: a replica then pushes several gradients per update)"))
        if not self.cluster.tls and (self.cluster.scheduler or self.cluster.security):
            problems.append((("cluster", "tls"), "tls: false applies to the embedded cluster; a running scheduler's "
                             "address says whether it uses TLS (tls:// with cluster.security): remove tls"))
        if t.wire_dtype != "float32" and (t.transport != "socket" or t.replication == "in_graph"):
            problems.append((("training", "wire_dtype"), f"wire_dtype {t.wire_dtype} needs transport: socket "
                             "and between_graph replication (Dask's serializer has no bfloat16)"))
        if t.replication == "in_graph" and t.mode == "async" and (t.overlap or t.max_staleness is not None):
            key = "overlap" if t.overlap else "max_staleness"
            problems.append((("training", key), f"{key} applies to between_graph replication (in_graph async "
                             "towers push one step at a time, unbounded); remove it or use replication: between_graph"))
        if t.mode == "sync" and (t.overlap or t.max_staleness is not None):
            key = "overlap" if t.overlap else "max_staleness"
            problems.append((("training", key), f"{key} applies to mode: async only; remove it or set mode: async"))
        if t.replicas_to_aggregate is not None and t.mode == "async":
            problems.append((("training", "replicas_to_aggregate"),
                             "replicas_to_aggregate applies to mode: sync only; remove it or set mode: sync"))
        ps_job, worker_job = self.placement.ps_job, self.placement.worker_job
        check_device(("placement", "worker_device"), self.placement.worker_device
                     if self.placement.worker_device.startswith("/") else None, worker_job)
        for name, dev in self.placement.variable_devices.items():
            check_device(("placement", "variable_devices", name), dev, ps_job)
            if DeviceSpec.from_string(dev).device_type == "GPU":
                # A shard is one flat float32 buffer in its task's CPU memory: a GPU type would only
                # change what `dtrain plan` prints.
                problems.append((("placement", "variable_devices", name),
                                 f"{dev!r}: variables live in their ps task's CPU memory (the ps applies updates "
                                 "there); a GPU device type is not supported for variables: pin the task only, "
                                 "e.g. /job:ps/task:0 (replicas compute on GPUs: placement.worker_device)"))

        model = self.model
        assert model is not None
        if model.layers is not None:
            for i, layer in enumerate(model.layers):
                check_device(("model", "layers", i, "device"), layer.device, worker_job)
            self._check_shapes(problems)
        for name, dev in self.placement.layer_devices.items():
            check_device(("placement", "layer_devices", name), dev, worker_job)
        if model.layers is not None and self.placement.layer_devices:
            problems.append((("placement", "layer_devices"), "layer_devices pins a model.module's children; "
                             "for model.layers set each layer's device instead"))
        if not problems:
            problems.extend(stage_problems(self))
        if not problems and elastic_of(self) is not None and stage_tasks(self) > 1:
            problems.append((("cluster", "jobs", self.placement.worker_job), "elastic replicas cannot be pipeline "
                             "stages (a stage needs its neighbours); give the job a number of tasks"))
        self._check_data(problems, base_dir, files=(info.context or {}).get("check_files", True))
        self._check_stream(problems, base_dir)
        self._check_imports(problems)
        self._check_tables(problems)
        if problems:
            raise CrossFieldErrors(problems)
        return self

    def has_sparse_tables(self) -> bool:
        """Whether the model holds a sparse embedding table (``model.module``: known once built)."""
        if self.model is not None and self.model.tables:
            return True
        layers = self.model.layers if self.model is not None else None
        first = layers[0] if layers else None
        return isinstance(first, EmbeddingLayer) and first.type in TABLE_LAYERS and first.sparse

    def _check_tables(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        """What sparse tables cannot do (torch's sparse gradients cannot either: docs/sparse.md), and
        incremental checkpoints without one (a custom module's tables are known once it is built)."""
        if not self.has_sparse_tables():
            if (self.checkpoint is not None and self.checkpoint.incremental is not None
                    and (self.model is None or self.model.module is None)):
                problems.append((("checkpoint", "incremental"), "incremental checkpoints hold the rows of sparse "
                                 "tables that changed, and the model has none: remove checkpoint.incremental (a "
                                 "dense model's checkpoints are always whole)"))
            return
        problems.extend(sparse_limits(self))

    def _check_imports(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        """The user's modules must be importable here; they are looked up, never imported (imports)."""
        assert self.model is not None
        if self.model.module is not None and (why := missing_module(self.model.module)):
            problems.append((("model", "module"), why))
        for i, hook in enumerate(self.hooks):
            if hook.type not in BUILTIN_HOOKS and (why := missing_module(hook.type)):
                problems.append((("hooks", i, "type"), f"custom hook: {why}"))

    def _check_data(self, problems: list[tuple[tuple[str | int, ...], str]], base_dir: Path,
                    files: bool = True) -> None:
        """The data section against the model; ``files``: also that the data files exist (not for a
        checkpoint's pipeline read back to serve its model: its data may be elsewhere by then)."""
        from dtrain.data.shards import ShardError, check_source, is_sharded
        from dtrain.data.sources import FILE_SUFFIXES, SKLEARN_DATASETS, data_source_kind, resolve_data_path

        assert self.model is not None
        loss, data = self.model.loss, self.data
        if loss == "cross_entropy" and data.task == "regression":
            problems.append((("data", "task"), "regression data needs loss: mse (cross_entropy is for classes)"))
        source = data.source
        kind = data_source_kind(source)
        layers = self.model.layers or []
        if kind != "file" and layers and layers[0].type in TABLE_LAYERS:
            problems.append((("data", "source"), f"{source!r} has float features, but model.layers[0] is an "
                             f"{layers[0].type} table, which takes integer ids: give an .npz file with an integer "
                             "'x' or a .csv/.parquet file with integer feature columns (e.g. python -m "
                             "dtrain.data.ctr --out ctr.npz writes click-through ids)"))
        if kind == "sklearn":
            name = source.split(":", 1)[1]
            if name not in SKLEARN_DATASETS:
                known = [f"sklearn:{n}" for n in SKLEARN_DATASETS]
                problems.append((("data", "source"), f"unknown scikit-learn dataset {source!r}"
                                 f"{did_you_mean(source, known)} (bundled: {', '.join(known)})"))
            elif name == "diabetes" and loss == "cross_entropy":
                problems.append((("data", "source"), "sklearn:diabetes is a regression dataset; "
                                 "set model.loss: mse"))
        elif kind == "file" and not files:
            pass
        elif kind == "file" and is_sharded(source, base_dir):
            for key in ("source", "eval_source"):
                value = getattr(data, key)
                if value is not None and "://" not in value:  # a remote listing waits for the run's preflight
                    try:  # (bounded: a huge tree, e.g. source: /, is listed by the run, not here)
                        check_source(value, base_dir)
                    except ShardError as exc:
                        problems.append((("data", key), str(exc)))
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
            if data.eval_source is not None:
                held = resolve_data_path(data.eval_source, base_dir)
                if held is None or held.suffix.lower() not in FILE_SUFFIXES:
                    problems.append((("data", "eval_source"), f"{data.eval_source!r}: the evaluation data of a "
                                     f"single file is a {'/'.join(FILE_SUFFIXES)} file like data.source"))
                elif not held.is_file():
                    problems.append((("data", "eval_source"), f"data file {data.eval_source!r} does not exist "
                                     f"(looked for {held})"))
        if kind != "file" and data.eval_source is not None:
            problems.append((("data", "eval_source"), f"{source!r} is generated, with its own held-out share "
                             "(test_fraction): eval_source applies to data read from files; remove it"))

    def _check_stream(self, problems: list[tuple[tuple[str | int, ...], str]], base_dir: Path) -> None:
        """Sharded sources: the keys that only they use, and the steps that end a run."""
        from dtrain.data.shards import is_sharded

        data, t = self.data, self.training
        if t.steps is None:  # training.steps is optional: the data's end (data.epochs) or 1000
            t.steps = MAX_STEPS if data.epochs else 1000
        sharded = is_sharded(data.source, base_dir)
        if not sharded:
            for key in STREAM_KEYS:  # (a default value is harmless: a dumped spec validates again)
                if getattr(data, key) != type(data).model_fields[key].default:
                    problems.append((("data", key), f"{key} applies to a sharded source (a glob, directory or URL "
                                     f"of .parquet/.csv/.npz files), not {data.source!r}: remove it"))
        elif t.replication == "in_graph":
            problems.append((("training", "replication"), "a sharded source is streamed by each replica's own "
                             "loop: use replication: between_graph (in_graph reads a file held in memory)"))
        if sharded and elastic_of(self) is not None:
            problems.append((("cluster", "jobs", self.placement.worker_job), "elastic replicas read in-memory data "
                             "(each slot its share of every epoch); a sharded source's files are split among fixed "
                             "replicas: give the job a number of tasks"))
        if data.epochs and t.replication == "in_graph":
            problems.append((("data", "epochs"), "data.epochs ends each replica's own loop; in_graph replication "
                             "counts training.steps only: remove data.epochs or use replication: between_graph"))

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


def sparse_limits(spec: PipelineSpec) -> list[tuple[tuple[str | int, ...], str]]:
    """Settings a model with sparse embedding tables cannot use, one problem each (also checked
    for ``model.module`` models once their tables are known, before start: chief/preflight.py)."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    opt: OptimizerSpec | None = spec.optimizer
    t = spec.training
    fix = "sparse tables take sgd, adagrad or adam (lazy Adam, torch.optim.SparseAdam)"
    tables = spec.model.tables if spec.model is not None else None
    if tables and all(table.optimizer is not None for table in tables.values()):
        opt = None  # every table has its own optimizer: the pipeline's applies to dense parameters only
    if opt is not None and opt.name == "momentum":
        out.append((("optimizer", "name"), f"momentum does not apply to sparse gradients (torch neither); {fix}, or "
                                           "set sparse: false on the embedding layer"))
    if opt is not None and opt.weight_decay and opt.name == "adam":  # sgd, adagrad: L2 on the touched rows
        out.append((("optimizer", "weight_decay"), "weight_decay does not apply to lazy Adam's sparse gradients "
                                                   "(torch.optim.SparseAdam has none; sgd and adagrad take it as L2 "
                                                   "on the rows a step touches): remove it, use sgd or adagrad, or "
                                                   "set sparse: false on the embedding layer"))
    if opt is not None and getattr(opt, "amsgrad", False):
        out.append((("optimizer", "amsgrad"), "amsgrad does not apply to sparse gradients (torch.optim.SparseAdam "
                                              "has none): remove it, or set sparse: false on the embedding layer"))
    if t.replication == "in_graph":
        out.append((("training", "replication"), "sparse tables need replication: between_graph (each replica "
                                                 "gathers its own rows); remove replication: in_graph"))
    if t.overlap:
        out.append((("training", "overlap"), "overlap does not apply to sparse tables (the next batch's rows come "
                                             "with the reply); remove it"))
    if t.moving_average is not None:
        out.append((("training", "moving_average"), "moving averages are kept for dense variables only, not sparse "
                                                    "tables; remove it, or set sparse: false on the embedding layer"))
    return out


# The embedded cluster's own settings: a running cluster's workers were started with theirs.
EMBEDDED_ONLY = ("memory_limit", "nthreads", "dashboard", "start_method")


def embedded_only_problems(spec: PipelineSpec, scheduler: str | None = None,
                           where: str | None = None) -> list[tuple[tuple[str | int, ...], str]]:
    """A key of the embedded cluster set in a pipeline that runs on a cluster of its own
    (``cluster.scheduler``, ``scheduler``: ``dtrain run --scheduler``, or ``where``: a
    description such as "client=") would do nothing: one problem per key, naming it."""
    if where is None:
        if spec.cluster.scheduler is not None:
            where = "cluster.scheduler names a running cluster"
        elif scheduler:
            where = f"this run is on the scheduler at {scheduler} (--scheduler)"
        else:
            return []
    return [(("cluster", key), f"{key} applies to the embedded cluster, and {where}, whose workers were started "
             f"with their own settings (dask worker --nthreads, --memory-limit, --dashboard-address): remove "
             f"cluster.{key}") for key in EMBEDDED_ONLY if key in _changed(spec.cluster)]


def _changed(section: BaseModel) -> list[str]:
    """The keys of ``section`` set to a value other than their default (a spec dumped and
    validated again, as ``model_dump()`` round trips do, sets every key to what it was)."""
    fields = type(section).model_fields
    return [key for key in section.model_fields_set
            if getattr(section, key) != fields[key].get_default(call_default_factory=True)]


def observe_problems(spec: PipelineSpec) -> list[tuple[tuple[str | int, ...], str]]:
    """``observe:`` measures the replicas' own loop (between_graph replication); an in-graph run
    or a graph pipeline has none, so a key set there would do nothing."""
    if "observe" not in spec.model_fields_set or not _changed(spec.observe):
        return []
    if spec.is_graph:
        why = "a graph pipeline has no replica loop to measure"
    elif spec.training.replication == "in_graph":
        why = "an in_graph run (towers driven by the chief) has no replica loop to measure"
    else:
        return []
    key = sorted(_changed(spec.observe))[0]
    return [(("observe", key), f"observe.{key} applies to between_graph replication; {why}: remove observe "
             "(or use replication: between_graph)")]

