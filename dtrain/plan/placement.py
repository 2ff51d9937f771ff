"""Variable placement over ps tasks: replica_device_setter's strategies, as pure functions.

``place_variables`` follows ``tf.compat.v1.train.replica_device_setter``
(``_ReplicaDeviceChooser.device_function``):

- a variable with no device, or a device in the ps job, asks the strategy for a task (which
  advances round robin / adds load) and is then merged with its own device, so a variable
  pinned to a ps task keeps its task yet still advances the counter;
- a variable pinned outside the ps job keeps its device and does not ask the strategy.

Strategies: ``round_robin`` (the default, in creation order), ``greedy`` (least bytes so far,
ties to the lowest task, like GreedyLoadBalancingStrategy with byte_size_load_fn) and
``partitioned`` (variables of at least ``min_slice_bytes`` are split along dim 0 into one part
per ps task, as ``fixed_size_partitioner`` does, each part then placed round robin). A device
left without a type gets ``/device:CPU:0``, so every device comes out canonical and complete.

One deliberate difference from TF: under ``greedy``, TF charges a variable's bytes to the task
the strategy picked even when the variable's own pin sends it to another ps task; dtrain charges
the task it really lands on, so the loads the strategy balances are the bytes each task holds
(``Plan.ps_bytes``). Without pins on ps tasks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.spec.device import DeviceSpec

PS_DEVICE_TYPE = DeviceSpec(device_type="CPU", device_index=0)
STRATEGIES = ("round_robin", "greedy", "partitioned")


@dataclass(frozen=True)
class VariableRequest:
    """A variable (or a part of one) to place: torch's name, its shape, bytes and optional device pin."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    pin: DeviceSpec | None = None
    source: str = ""  # the parameter this part belongs to
    start: int = 0  # first element of this part within the parameter (flattened)
    axis: int = 0  # a part: the axis it was split along (plan/partitioners.py)
    blocks: int = 1  # a part along an inner axis: runs of consecutive elements in the parameter...
    stride: int = 0  # ...this many elements apart (0: one run)
    slice_spec: str = ""  # a part: TensorFlow's save-slice spec, e.g. "20 43 0,20:15,14"


def names_variable(key: str, name: str) -> bool:
    """Whether a key of ``variable_devices`` or ``partitioner.variables`` names the variable ``name``:
    its exact name, or a prefix ending in '.' (``"0."`` names ``0.weight`` and ``0.bias``)."""
    return name == key or (key.endswith(".") and name.startswith(key))


def place_variables(requests: list[VariableRequest], ps_job: str, num_ps: int,
                    strategy: str) -> list[DeviceSpec]:
    """The device of each request, in order (see the module docstring for the rules)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    ps_device = DeviceSpec(job=ps_job)
    next_task = 0
    load = [0] * num_ps
    out: list[DeviceSpec] = []
    for req in requests:
        current = req.pin or DeviceSpec()
        if num_ps and (current.job is None or current.job == ps_job):
            if strategy == "greedy":
                task = min(range(num_ps), key=lambda t: (load[t], t))
            else:
                task = next_task
                next_task = (next_task + 1) % num_ps
            device = ps_device.replace(task=task).make_merged_spec(current)
            if device.task is not None and device.task < num_ps:
                load[device.task] += req.nbytes
        else:
            device = current
        if device.device_type is None:
            device = device.make_merged_spec(PS_DEVICE_TYPE)
        out.append(device)
    return out
