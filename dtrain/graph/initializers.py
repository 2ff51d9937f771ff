"""Graph variables' initializers (TF1's ``tf.*_initializer``): pure torch, float32, seeded.

Each draw uses its own ``torch.Generator`` seeded with the variable's seed (resolved by the
compiler, ``spec/graph.py``) on the CPU, then moves to the node's device: the same seed gives the
same values on any worker and device, and the process's global RNG is left alone. The values are
torch's draws, not TF's (the two use different generators): the same distribution, not the same
numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

INITIALIZERS = ("zeros", "ones", "random_normal", "random_uniform", "truncated_normal")


def initialize(init: Mapping[str, Any], shape: Sequence[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """A float32 tensor of ``shape`` drawn as ``init`` says ({type, seed, mean, stddev, minval, maxval})."""
    kind = init["type"]
    size = tuple(int(d) for d in shape)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(init.get("seed") or 0))
    if kind == "zeros":
        out = torch.zeros(size)
    elif kind == "ones":
        out = torch.ones(size)
    elif kind == "random_normal":
        out = torch.randn(size, generator=gen) * float(init["stddev"]) + float(init["mean"])
    elif kind == "random_uniform":
        lo, hi = float(init["minval"]), float(init["maxval"])
        out = torch.rand(size, generator=gen) * (hi - lo) + lo
    elif kind == "truncated_normal":
        # TF draws again any value more than 2 standard deviations from the mean; torch's trunc_normal_
        # samples the same truncated distribution.
        mean, std = float(init["mean"]), float(init["stddev"])
        out = torch.nn.init.trunc_normal_(torch.empty(size), mean=mean, std=std, a=mean - 2 * std,
                                          b=mean + 2 * std, generator=gen)
    else:
        raise ValueError(f"unknown initializer {kind!r}; known: {', '.join(INITIALIZERS)}")
    return out.to(dtype=torch.float32, device=device)
