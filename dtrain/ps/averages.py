"""Exponential moving averages of a shard's variables (``training.moving_average``).

TensorFlow's ``tf.train.ExponentialMovingAverage`` as ``SyncReplicasOptimizer(variable_averages=
ema, variables_to_average=...)`` runs it: after every applied update, each averaged variable's
shadow moves towards the variable,

    shadow = decay * shadow + (1 - decay) * variable

with ``decay = min(decay, (1 + n) / (10 + n))`` when ``num_updates`` is given (``n``: TF passes
the global step, read after the update that just incremented it; here the shard's step after the
apply, the same number). The shadow starts at the variable's initial value, as TF's does.

The ps keeps one shadow per shard, as one flat buffer beside the parameters, and updates it with
one in-place ``lerp_`` per apply (no temporary). A shard without ``moving_average`` has no
:class:`MovingAverage` at all: its apply path does not change. Pure torch (no Dask).
"""

from __future__ import annotations

from typing import Any

import torch


def decay_at(decay: float, num_updates: int | None) -> float:
    """TF's effective decay: ``decay``, or ``min(decay, (1 + n) / (10 + n))`` with ``num_updates``."""
    if num_updates is None:
        return decay
    return min(decay, (1.0 + num_updates) / (10.0 + num_updates))


class MovingAverage:
    """The shadow of one flat parameter buffer (see the module docstring)."""

    def __init__(self, init: torch.Tensor, decay: float, num_updates: bool = False):
        self.decay = float(decay)
        self.num_updates = bool(num_updates)
        self.shadow = init.detach().to(torch.float32).clone()

    @torch.no_grad()
    def update(self, param: torch.Tensor, step: int) -> None:
        """Move the shadow towards ``param`` after the apply that made the shard's step ``step``."""
        d = decay_at(self.decay, step if self.num_updates else None)
        self.shadow.lerp_(param, 1.0 - d)

    def reset(self, param: torch.Tensor) -> None:
        """Start over from ``param`` (a resume from a checkpoint written without averages)."""
        self.shadow.copy_(param)

    def state(self) -> torch.Tensor:
        """A copy of the shadow, for a checkpoint (``get_state``'s ``averages``)."""
        return self.shadow.clone()

    def load(self, shadow: Any, param: torch.Tensor) -> None:
        """Restore the shadow written by :meth:`state`; ``None`` (not in the checkpoint) starts it
        from ``param``, the restored variables."""
        if shadow is None:
            self.reset(param)
        else:
            self.shadow.copy_(shadow)


def make_average(config: dict[str, Any] | None, init: torch.Tensor) -> MovingAverage | None:
    """The shard's :class:`MovingAverage` for a ``training.moving_average`` section (a plain dict), or
    None when the section is absent."""
    if not config:
        return None
    return MovingAverage(init, config["decay"], config.get("num_updates", False))
