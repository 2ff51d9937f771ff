"""Single-process plain-PyTorch training, the yardstick of synchronous replication's fidelity.

N replicas of batch b in sync mode must give the parameters of one process training with batch
N*b on the same samples: batch j is the training-split rows at
``ShardIterator.global_batch_indices(j, N*b, ...)``.
"""

from __future__ import annotations

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
    raise ValueError(f"no reference for optimizer {o.name!r}")


def single_process(spec: dtrain.PipelineSpec, num_replicas: int, steps: int | None = None) -> torch.nn.Module:
    """The model after ``steps`` (default ``training.steps``) plain torch steps of batch
    ``num_replicas * data.batch_size``."""
    data = dataset_for(spec)
    x = torch.as_tensor(data.x_train, dtype=torch.float32)
    y = torch.as_tensor(data.y_train)
    model = dtrain.build_model(spec)
    model.train()
    opt = torch_optimizer(spec, model.parameters())
    loss_fn = LOSSES[spec.model.loss]()
    global_batch = num_replicas * spec.data.batch_size
    for j in range(spec.training.steps if steps is None else steps):
        idx = torch.as_tensor(ShardIterator.global_batch_indices(
            j, global_batch, n_samples=len(x), seed=spec.training.seed, shuffle=spec.data.shuffle))
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return max(float((pa[n].detach().cpu() - pb[n].detach().cpu()).abs().max()) for n in pa)
