"""Single-process plain-PyTorch training, the yardstick of synchronous replication's fidelity.

N replicas of batch b in sync mode must give the parameters of one process training with batch
N*b on the same samples: batch j is the training-split rows at
``ShardIterator.global_batch_indices(j, N*b, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import dtrain
from dtrain.data.sampling import ShardIterator
from dtrain.worker.replica import dataset_for

LOSSES = {"cross_entropy": torch.nn.CrossEntropyLoss, "mse": torch.nn.MSELoss,
          "bce_with_logits": torch.nn.BCEWithLogitsLoss}


def torch_optimizer(spec: dtrain.PipelineSpec, params) -> torch.optim.Optimizer:
    o = spec.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "momentum":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, dampening=o.dampening,
                               weight_decay=o.weight_decay)
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, betas=o.betas, eps=o.eps, amsgrad=o.amsgrad,
                                weight_decay=o.weight_decay)
    if o.name == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, lr_decay=o.lr_decay, eps=o.eps,
                                   initial_accumulator_value=o.initial_accumulator_value, weight_decay=o.weight_decay)
    raise ValueError(f"no reference for optimizer {o.name!r}")


def sparse_optimizers(spec: dtrain.PipelineSpec, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's own optimizers for a model with sparse embeddings: the dense parameters get the
    pipeline's optimizer, the tables torch's sparse one (SparseAdam for adam)."""
    from dtrain.model.tables import tables_of

    table_names = {name for name, _ in tables_of(model)}
    tables = [p for n, p in model.named_parameters() if n in table_names]
    dense = [p for n, p in model.named_parameters() if n not in table_names]
    o = spec.optimizer
    sparse = torch.optim.SparseAdam(tables, lr=o.lr, betas=o.betas, eps=o.eps) if o.name == "adam" \
        else torch_optimizer(spec, tables)
    return [torch_optimizer(spec, dense), sparse]


def single_process(spec: dtrain.PipelineSpec, num_replicas: int, steps: int | None = None,
                   on_step: Callable[[int, torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The model after ``steps`` (default ``training.steps``) plain torch steps of batch
    ``num_replicas * data.batch_size``. ``on_step(step, model)``: called after each step (1, 2, ...)
    and once before the first (0), e.g. to follow the parameters' trajectory."""
    data = dataset_for(spec)
    ids = data.x_train.dtype.kind in "iu"
    x = torch.as_tensor(data.x_train, dtype=torch.int64 if ids else torch.float32)
    y = torch.as_tensor(data.y_train)
    model = dtrain.build_model(spec)  # a sparse table: a torch sparse embedding (F.embedding(sparse=True))
    model.train()
    opts = sparse_optimizers(spec, model) if ids else [torch_optimizer(spec, model.parameters())]
    loss_fn = LOSSES[spec.model.loss]()
    if spec.model.loss == "bce_with_logits":  # (batch, 1) logits against 0/1 labels
        bce = loss_fn
        loss_fn = lambda out, target: bce(out.reshape(-1), target.float())  # noqa: E731
    global_batch = num_replicas * spec.data.batch_size
    if on_step is not None:
        on_step(0, model)
    for j in range(spec.training.steps if steps is None else steps):
        idx = torch.as_tensor(ShardIterator.global_batch_indices(
            j, global_batch, n_samples=len(x), seed=spec.training.seed, shuffle=spec.data.shuffle))
        for opt in opts:
            opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        for opt in opts:
            opt.step()
        if on_step is not None:
            on_step(j + 1, model)
    return model


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return max(float((pa[n].detach().cpu() - pb[n].detach().cpu()).abs().max()) for n in pa)


def binary_accuracy(model: torch.nn.Module, spec: dtrain.PipelineSpec) -> float:
    """``model``'s accuracy on ``spec``'s test split of a binary task (a logit per sample)."""
    data = dataset_for(spec)
    with torch.no_grad():
        logits = model(torch.as_tensor(data.x_test)).reshape(-1)
    return float(((logits > 0).long() == torch.as_tensor(data.y_test)).float().mean())
