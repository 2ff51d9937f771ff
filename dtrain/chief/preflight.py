"""What ``dtrain plan`` and ``dtrain run`` check before anything starts, beyond ``validate``.

``dtrain validate`` never imports the user's code nor reads the data (``dtrain.spec``). Before a
cluster starts, the chief does both, so that a pipeline that cannot run fails with exit 2 and a
``FILE:LINE: path: message`` line rather than a traceback or a replica's error after start-up:

- the custom hooks are imported and built (``hooks[i].type`` / ``hooks[i].args``);
- the model is built on torch's meta device: a module that cannot be imported, a missing attribute,
  a factory that raises or does not return an ``nn.Module`` is a problem at ``model.module``;
- the data is loaded (as every replica loads it): a bad or non-finite file is a problem at
  ``data.source``;
- the data fits the model: the examples' shape against ``model.input_shape`` (and, for a custom
  module, a forward on the meta device with the data's shape), the labels against the model's
  outputs (labels {0, 1000000} are 1000001 classes, not 2);
- the plan compiles (variable pins), and on the embedded cluster each ps task's parameters and
  optimizer state fit its worker's ``cluster.memory_limit``. That plan is the run's: ``dtrain
  run`` and ``dtrain plan`` compile nothing more, they put it on the cluster's workers
  (:class:`Preflight`).

Problems carry dotted paths but no file: the CLI gives them their lines
(:func:`dtrain.spec.loading.locate`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from dtrain.plan.compiler import Plan
from dtrain.spec.errors import Problem, SpecError
from dtrain.spec.pipeline import PipelineSpec

from .hooks import Hook, build_hooks
from .inputs import sharded

# Float32 buffers a ParameterShard keeps per parameter, besides the parameter itself: the
# optimizer's scratch buffer and, in sync mode, the step's gradient sum, plus the optimizer's
# state (dtrain.ps.optim). tests/chief/test_preflight.py counts them on a real shard.
PS_BUFFERS = 1
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 3, "adagrad": 2}  # adam: +1 with amsgrad


class Preflight(NamedTuple):
    """What the checks built: the hooks, and the plan compiled from the spec (with a sharded set of
    files' assignment; on no workers yet; None for a graph pipeline, compiled where it runs)."""

    hooks: list[Hook]
    plan: Plan | None


def check_before_start(spec: PipelineSpec, *, embedded: bool, collection: bool = False) -> Preflight:
    """Run every check (see the module docstring) and return the built hooks and the compiled
    plan; SpecError listing every problem otherwise. ``embedded``: the run starts its own cluster
    (memory limits apply). ``collection``: the data is a Dask collection, checked once on the
    cluster (:func:`collection_data`), and assigned to the replicas there."""
    problems: list[Problem] = []
    hooks: list[Hook] = []
    plan: Plan | None = None
    try:
        hooks = build_hooks(spec.hooks)
    except SpecError as exc:
        problems += exc.problems
    if spec.cluster.adaptive is not None and not embedded:
        problems.append(Problem("scales the embedded cluster, and this run is on a cluster of yours (--scheduler, "
                                "client=): remove cluster.adaptive and call that cluster's adapt(); the elastic "
                                "replicas follow it (docs/elastic.md)", path="cluster.adaptive"))
    if spec.is_graph:
        if problems:
            raise SpecError(problems)
        return Preflight(hooks, None)
    skeleton = _skeleton(spec, problems)
    if skeleton is not None and spec.model is not None and spec.model.module is not None:
        _module_tables(spec, skeleton, problems)
        if problems:
            raise SpecError(problems)
    if spec.model is not None and spec.model.features is not None and not collection and not sharded(spec):
        problems.append(Problem(f"{spec.data.source!r} is not a sharded source: a model with model.features reads "
                                "Criteo-layout .tsv/.tsv.gz files or .parquet files (a file, a glob or a directory), "
                                "or (x, y) dask arrays packed by dtrain.data.features.RecordLayout given to "
                                "dtrain.run(spec, data=...)", path="data.source"))
        raise SpecError(problems)
    data = None if collection else _dataset(spec, problems)
    if skeleton is not None and data is not None:
        _fits(spec, skeleton, data, problems)
    if skeleton is not None and not problems:
        from dtrain.plan.compiler import compile

        from .inputs import file_input

        try:
            plan = compile(spec, data=file_input(spec, with_stats=False) if sharded(spec) and not collection else None)
        except SpecError as exc:
            problems += exc.problems
        else:
            if embedded:
                _memory(spec, plan, problems)
            if plan.stages and spec.model is not None and spec.model.module is not None:
                _sequential(spec, problems)
    if problems:
        raise SpecError(problems)
    return Preflight(hooks, plan)


def collection_data(spec: PipelineSpec, client: Any, data: Any) -> Any:
    """A Dask collection given to ``dtrain.run(spec, data=...)`` as shards (``inputs.collection_input``),
    checked against the model as a file would be; SpecError (at ``data``) otherwise."""
    from .inputs import collection_input

    problems: list[Problem] = []
    try:
        data_input = collection_input(spec, client, data)
    except (TypeError, ValueError) as exc:
        raise SpecError([Problem(f"the Dask collection given as data= cannot be used: {_one_line(exc)}",
                                 path="data")]) from None
    skeleton = _skeleton(spec, problems)
    if skeleton is not None:
        _fits(spec, skeleton, data_input.stats, problems)
    if problems:
        raise SpecError(problems)
    return data_input


def ps_state_bytes(param_bytes: int, optimizer: Any, table_bytes: int = 0, averages: bool = False,
                   sync: bool = True) -> int:
    """Bytes a ps task holds for ``param_bytes`` of dense parameters (the parameters, their
    scratch buffer, with ``sync`` a step's gradient sum, the optimizer's state, and with
    ``averages`` their moving averages: training.moving_average) and ``table_bytes`` of sparse
    table parts as the plan counts them (``ShardPlan.table_bytes``: each part's rows in its
    storage dtype plus its own row optimizer's state, dtrain.plan.tables). A lower bound: reply
    buffers and a step's pushed rows come on top."""
    state = OPTIMIZER_STATE[optimizer.name] + int(bool(getattr(optimizer, "amsgrad", False))) + int(averages)
    return param_bytes * (1 + PS_BUFFERS + int(sync) + state) + table_bytes


# ------------------------------------------------------------------------------------------ checks


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _skeleton(spec: PipelineSpec, problems: list[Problem]) -> Any:
    from dtrain.model.build import build_model_skeleton
    from dtrain.model.layers import NotAModuleError

    model = spec.model
    assert model is not None
    if model.module is None:
        return build_model_skeleton(spec)  # layers: already checked by the spec, on meta
    try:
        return build_model_skeleton(spec)
    except ImportError as exc:
        why = f"cannot be imported: {_one_line(exc)}"
    except NotAModuleError as exc:
        why = f"is not an nn.Module class or factory: {_one_line(exc)}"
    except Exception as exc:  # the user's module or factory raised: anything may come out
        why = f"failed while importing or building the model: {type(exc).__name__}: {_one_line(exc)}"
    problems.append(Problem(f"{model.module!r} {why}", path="model.module"))
    return None


def _module_tables(spec: PipelineSpec, skeleton: Any, problems: list[Problem]) -> None:
    """A ``model.module``'s sparse embeddings are ps tables (dtrain.model.tables.swap_embeddings):
    the settings tables cannot use are refused here, as validation does for ``model.layers``."""
    from dtrain.model.tables import tables_of
    from dtrain.spec.pipeline import sparse_limits

    tables = tables_of(skeleton)
    if tables:
        # A table with its own optimizer config (Table.optimizer) does not use the run's optimizer:
        # the run's settings that sparse gradients cannot take matter only for the others.
        own = all(getattr(t, "optimizer", None) is not None for _, t in tables)
        problems.extend(Problem(message, path=".".join(map(str, loc))) for loc, message in sparse_limits(spec)
                        if not (own and loc[0] == "optimizer"))
        rows = sum(t.num_embeddings * t.dim for _, t in tables)
        if rows <= OWN_INIT_CHECK_VALUES:
            _module_init(spec, problems)


OWN_INIT_CHECK_VALUES = 1 << 26
"""A module whose sparse embeddings hold at most this many values is built once for real before
start, to see whether its own code initialises them (larger ones: declare ``dtrain_init``)."""


def _module_init(spec: PipelineSpec, problems: list[Problem]) -> None:
    """A module that sets its sparse embeddings' initial values itself, without declaring them, is
    refused: its ps tables would start from normal(0, 1) instead (dtrain.model.tables.undeclared_init)."""
    import torch

    from dtrain.model.build import build_custom
    from dtrain.model.tables import undeclared_init

    model = spec.model
    assert model is not None and model.module is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.training.seed)
        try:
            module = build_custom(model.module, model.kwargs, "cpu")  # its own code only: no reset
        except Exception:
            return  # reported where the module is built (the skeleton's check)
    problems.extend(Problem(message, path="model.module") for message in undeclared_init(module))


def _dataset(spec: PipelineSpec, problems: list[Problem]) -> Any:
    from dtrain.worker.replica import dataset_for

    from .inputs import file_input, sharded

    try:
        if sharded(spec):  # the headers, then one statistics pass with Dask (cached: the session reuses it)
            return file_input(spec).stats
        return dataset_for(spec)  # cached: the chief's evaluation reuses it
    except (ValueError, OSError) as exc:
        path = "data.eval_source" if spec.data.eval_source and spec.data.eval_source in str(exc) else "data.source"
        problems.append(Problem(f"cannot load {spec.data.source!r}: {_one_line(exc)}", path=path))
        return None


def _model_outputs(spec: PipelineSpec) -> str:
    """Where the model's output size is set, for messages."""
    model = spec.model
    assert model is not None
    if model.layers is None:
        return f"model.module {model.module!r}"
    linear = [i for i, layer in enumerate(model.layers) if layer.type == "linear"]
    return f"model.layers[{linear[-1]}].out" if linear else "model.layers"


def _fits(spec: PipelineSpec, skeleton: Any, data: Any, problems: list[Problem]) -> None:
    from dtrain.model.layers import check_output, infer_shapes, output_shape

    model = spec.model
    assert model is not None
    source = spec.data.source
    shape = tuple(data.feature_shape)
    if model.layers is not None:
        want = tuple(model.input_shape or ())
        if shape != want:
            fix = (f"set model.input_shape: {list(shape)}"
                   + (" and start the layers with {type: reshape, shape: " + str(list(want)) + "}"
                      if math.prod(shape) == math.prod(want) else ""))
            problems.append(Problem(f"the examples of {source!r} have shape {shape} ({math.prod(shape)} features) "
                                    f"but model.input_shape is {list(want)}: {fix}", path="data.source"))
            return
        out = infer_shapes(want, [layer.model_dump() for layer in model.layers])[-1]
    elif model.dlrm is not None:  # its records are packed by model.features' own layout
        out = (model.dlrm.top[-1],)
    else:
        try:
            import torch

            ids = data.ids if hasattr(data, "ids") else data.x_train.dtype.kind in "iu"  # ids for its tables
            out = output_shape(skeleton, shape, torch.int64 if ids else torch.float32)
        except NotImplementedError:
            return  # an operation torch's meta device cannot run: the check needs real tensors
        except Exception as exc:
            if "meta" in str(exc).lower():  # data-dependent code (.item(), ...): not checkable on meta
                return
            problems.append(Problem(f"{model.module!r} fails on the examples of {source!r}, of shape {shape}: "
                                    f"{type(exc).__name__}: {_one_line(exc)}", path="model.module"))
            return
    loss = model.loss
    if loss == "cross_entropy" and data.task == "regression":
        problems.append(Problem(f"the targets of {source!r} are not integer class labels (read as a regression "
                                "target) but model.loss is cross_entropy: store integer labels (or set data.task: "
                                "classification), or use loss: mse", path="data.source"))
        return
    classes = data.num_classes if loss == "cross_entropy" else None
    if loss == "cross_entropy" and classes is not None and len(out) == 1 and out[0] < classes:
        top = max(data.classes) if data.classes and all(isinstance(c, int) for c in data.classes) else None
        labels = (f"its labels run up to {top}, so they are {classes} classes (non-negative integer labels are "
                  "class ids)" if top is not None else f"it has {classes} classes")
        problems.append(Problem(f"{source!r}: {labels}, but {_model_outputs(spec)} gives {out[0]} outputs per "
                                f"example: use labels 0..{out[0] - 1}, or make the model output {classes}",
                                path="data.source"))
        return
    if loss == "bce_with_logits" and data.num_classes is not None and data.num_classes > 2:
        problems.append(Problem(f"{source!r} has {data.num_classes} classes but bce_with_logits needs labels 0 and 1 "
                                "(one logit per example): use cross_entropy for more classes", path="data.source"))
        return
    try:
        check_output(out, loss, classes)
    except ValueError as exc:
        path = "model.module" if model.layers is None else "model.layers"
        problems.append(Problem(f"{exc} (with the data of {source!r})", path=path))


def _sequential(spec: PipelineSpec, problems: list[Problem]) -> None:
    """A ``model.module`` split into pipeline stages must compute what it computes whole when its
    children run one after the other (the plan checked the shapes on the meta device; a residual
    connection or a branch keeps the shapes but not the values): one real forward of two examples."""
    import torch

    from dtrain.model.build import build_model

    model = build_model(spec).eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = torch.randn(2, *(spec.model.input_shape or ()))  # type: ignore[union-attr]
        whole, h = model(x), x
        for _, child in model.named_children():
            h = child(h)
    if h.shape != whole.shape or not torch.allclose(h, whole, rtol=1e-4, atol=1e-5):
        problems.append(Problem(f"{spec.model.module} cannot be split into pipeline stages: its children run one "  # type: ignore[union-attr]
                                "after the other do not compute what its forward computes (a residual connection, "
                                "a branch, or a child used twice?); make its forward a sequence of its children or "
                                "remove placement.layer_devices", path="placement.layer_devices"))


def _memory(spec: PipelineSpec, plan: Plan, problems: list[Problem]) -> None:
    from dtrain.spec.sizes import memory_limit_bytes

    limit = memory_limit_bytes(spec.cluster.memory_limit)
    if limit is None:  # auto or no limit
        return
    tables = {s.task: s.table_bytes for s in plan.shards}
    for task, nbytes in plan.ps_bytes.items():
        rows = tables.get(task, 0)
        sync = spec.training.mode == "sync"
        need = ps_state_bytes(nbytes - rows, spec.optimizer, rows, averages=spec.training.moving_average is not None,
                              sync=sync)
        if need > limit:
            dense = (f"with their {'gradient sum, ' if sync else ''}scratch buffer and {spec.optimizer.name} state")
            fix = ("raise cluster.memory_limit, add ps tasks, or split large variables over the ps tasks with "
                   "placement.partitioner (e.g. {type: min_max, max_partitions: 8})")
            if not rows:
                what = f"{nbytes} bytes of parameters, {dense}"
            else:
                parts = [(p.bytes, t, p) for t in plan.tables for p in t.parts if plan.shards[p.shard].task == task]
                size, table, part = max(parts, key=lambda x: x[0])
                what = (f"{nbytes - rows} bytes of dense parameters {dense}, and {rows} bytes of sparse table rows "
                        f"with their row optimizer state; the largest table on it, {table.name}, holds {size} bytes "
                        f"there: {part.rows} rows of {table.dim} in {table.storage} with {table.optimizer_name} "
                        "state")
                fix = "raise cluster.memory_limit or add ps tasks (a table's rows are split over all of them)"
                if spec.model is not None and spec.model.module is not None:
                    fix += (", or make the table smaller: Table(storage='bfloat16') halves its rows, a Table "
                            "optimizer {name: rowwise_adagrad} keeps one float of state per row")
            problems.append(Problem(
                f"ps task {task} needs at least {need} bytes ({what}), more than its worker's memory_limit "
                f"{spec.cluster.memory_limit!r} ({limit} bytes): {fix}", path="cluster.memory_limit"))
