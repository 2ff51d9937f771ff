"""Device specifications, modelled on TensorFlow's ``tf.DeviceSpec``.

A device string names (part of) a place in the cluster where work runs::

    /job:<name>/replica:<int>/task:<int>/device:<TYPE>:<int or *>

Grammar accepted by :meth:`DeviceSpec.from_string` (same as TF2's parser,
with a few stricter checks noted below)::

    spec      := "" | component ("/" component)*   (a leading "/" is optional)
    component := ""                                 (empty parts are skipped)
               | "job:" (NAME | "*")                NAME: [a-zA-Z][_a-zA-Z0-9]*
               | "replica:" (INT | "*")             INT: decimal, >= 0
               | "task:" (INT | "*")
               | "device:" TYPE [":" (INT | "*")]
               | SHORT [":" (INT | "*")]            SHORT: cpu, gpu or tpu, any case

Rules, following TF:

* Components may come in any order; ``to_string`` always emits the canonical
  order job, replica, task, device and omits unset fields.
* A later ``job``/``replica``/``task`` component overrides an earlier one,
  but giving the device twice (``/device:GPU:0/cpu:0``) is a ``ValueError``.
* ``*`` as the device index means "unset" (``device_index is None``); a device
  with an unset index is written ``/device:GPU:*``. As in TF's C++ parser
  (``DeviceNameUtils::ParseFullName``), ``job:*``, ``replica:*`` and ``task:*``
  leave the field unset too (Python's ``tf.DeviceSpec`` would keep a job named
  ``*``).
* Job names follow the C++ rule a TF server enforces, ``[a-zA-Z][_a-zA-Z0-9]*``
  (Python's ``tf.DeviceSpec`` takes any string): ``/job:123`` is refused.
* ``CPU`` and ``GPU`` are canonicalised to upper case whatever case they are
  written in; short forms (``/tpu:0``) are upper-cased; any other type given
  through ``device:`` is kept as written (TF: ``/device:MyFunnyDevice:2``).

Stricter than TF: empty job names, negative integers and ``/device:`` without
a type are rejected. Looser than TF: ``/device:GPU`` (no index) is accepted
and means ``/device:GPU:*``.

Nested scopes (``with tf.device(outer): with tf.device(inner): ...``) combine
with :func:`merge_device` / :meth:`DeviceSpec.make_merged_spec`: a plain
field-wise override where each field set in the inner spec wins and each unset
field is taken from the outer one (TF's ``_get_combined_properties``).
As in TF, an empty inner spec (``tf.device("")``) inherits the outer one,
while ``None`` (``tf.device(None)``), or the keyword ``none``, clears every
outer scope: ``merge_device(outer, None)`` is the empty spec.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceSpec", "merge_device", "parse_device", "GRAMMAR", "CLEAR", "JOB_NAME_RULE", "is_clear"]

GRAMMAR = (
    "/job:<name>/replica:<int>/task:<int>/device:<TYPE>:<int|*> "
    "(any subset, any order; short device forms cpu:<int|*>, gpu:<int|*>, "
    "tpu:<int|*>)"
)

_SHORT_TYPES = frozenset({"CPU", "GPU", "TPU"})
_CANONICAL_UPPER = frozenset({"CPU", "GPU"})
_INT_RE = re.compile(r"[0-9]+\Z")
JOB_NAME_RULE = "[a-zA-Z][_a-zA-Z0-9]*"
"""Job names, as TF's C++ parser (and so a TF server) requires: a letter, then letters, digits or '_'."""
_JOB_RE = re.compile(JOB_NAME_RULE + r"\Z")
CLEAR = "none"
"""The device keyword that clears every enclosing scope, like ``tf.device(None)`` (``is_clear``)."""
_TYPE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _check_job(job: Any) -> str | None:
    if job is None:
        return None
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(
            f"invalid job name {job!r}: a job name must match {JOB_NAME_RULE} (a letter, then letters, digits "
            "or '_'), as TensorFlow's servers require"
        )
    return job


def _check_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and _INT_RE.match(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"invalid {name} {value!r}: must be a non-negative int")
    return int(value)


def _check_type(device_type: Any) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str) or not _TYPE_RE.match(device_type):
        raise ValueError(f"invalid device type {device_type!r}: must match [A-Za-z_][A-Za-z0-9_]*")
    upper = device_type.upper()
    return upper if upper in _CANONICAL_UPPER else device_type


@dataclass(frozen=True)
class DeviceSpec:
    """Immutable (partial) device specification; unset fields are ``None``.

    >>> str(DeviceSpec.from_string("/task:1/job:ps/gpu:0"))
    '/job:ps/task:1/device:GPU:0'
    """

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "job", _check_job(self.job))
        object.__setattr__(self, "replica", _check_int("replica", self.replica))
        object.__setattr__(self, "task", _check_int("task", self.task))
        object.__setattr__(self, "device_type", _check_type(self.device_type))
        object.__setattr__(self, "device_index", _check_int("device_index", self.device_index))

    # ------------------------------------------------------------------ parse
    @classmethod
    def from_string(cls, spec: str | None) -> DeviceSpec:
        """Parse a device string (see module docstring); ``None``/"" -> empty."""
        if spec is None:
            return cls()
        if not isinstance(spec, str):
            raise TypeError(f"device spec must be a str, got {type(spec).__name__}")
        fields: dict[str, Any] = {}
        have_device = False
        for part in spec.split("/"):
            if part == "":
                continue

            def bad(why: str, part: str = part) -> ValueError:
                return ValueError(
                    f"invalid device spec {spec!r}: component {part!r} {why}; expected {GRAMMAR}"
                )

            pieces = part.split(":")
            key = pieces[0]
            if key in ("job", "replica", "task"):
                if len(pieces) != 2:
                    raise bad(f"must look like '{key}:<value>'")
                value = pieces[1]
                if value == "*":  # unset, as TF's C++ parser reads it
                    fields.pop(key, None)
                elif key == "job":
                    if not _JOB_RE.match(value):
                        raise bad(f"has an invalid job name: a job name must match {JOB_NAME_RULE} (a letter, then "
                                  "letters, digits or '_'), as TensorFlow's servers require")
                    fields["job"] = value
                else:
                    if not _INT_RE.match(value):
                        raise bad(f"needs a non-negative integer {key}")
                    fields[key] = int(value)
                continue
            if key == "device" and len(pieces) in (2, 3):
                dtype, index = pieces[1], (pieces[2] if len(pieces) == 3 else "*")
                if not _TYPE_RE.match(dtype):
                    raise bad("has an empty or invalid device type")
            elif key.upper() in _SHORT_TYPES and len(pieces) in (1, 2):
                dtype = key.upper()
                index = pieces[1] if len(pieces) == 2 else "*"
            else:
                raise bad("is not a known attribute")
            if have_device:
                raise bad("gives a second device; multiple device types are not allowed")
            if index != "*" and not _INT_RE.match(index):
                raise bad("needs a non-negative integer device index or '*'")
            have_device = True
            fields["device_type"] = dtype
            fields["device_index"] = None if index == "*" else int(index)
        return cls(**fields)

    # ----------------------------------------------------------------- format
    def to_string(self) -> str:
        """Canonical ``/job:J/replica:R/task:T/device:TYPE:I`` (unset omitted)."""
        out = []
        if self.job is not None:
            out.append(f"/job:{self.job}")
        if self.replica is not None:
            out.append(f"/replica:{self.replica}")
        if self.task is not None:
            out.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            out.append(f"/device:{self.device_type}:{index}")
        return "".join(out)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        ]
        return f"DeviceSpec({', '.join(parts)})"

    # ------------------------------------------------------------------ merge
    def make_merged_spec(self, dev: DeviceSpec) -> DeviceSpec:
        """Return ``self`` overridden field-wise by the set fields of ``dev``.

        ``dev`` plays the inner (nested) scope: every field it sets wins, every
        field it leaves unset is taken from ``self``. As in TF this is a plain
        per-field override; e.g. merging ``/device:GPU:1`` with ``/device:CPU:*``
        gives ``/device:CPU:1``.
        """
        if not isinstance(dev, DeviceSpec):
            raise TypeError(f"expected DeviceSpec, got {type(dev).__name__}")
        return DeviceSpec(
            *(
                getattr(dev, f.name) if getattr(dev, f.name) is not None else getattr(self, f.name)
                for f in dataclasses.fields(self)
            )
        )

    def replace(self, **kwargs: Any) -> DeviceSpec:
        """Return a copy with the given fields replaced (``None`` unsets)."""
        return dataclasses.replace(self, **kwargs)

    # ---------------------------------------------------------------- helpers
    @property
    def is_cpu(self) -> bool:
        return self.device_type == "CPU"

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "GPU"

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def task_key(self) -> str:
        """``/job:J/task:T`` identifying the process; ValueError if either unset."""
        if self.job is None or self.task is None:
            raise ValueError(f"device spec {self.to_string()!r} needs both job and task set to name a task")
        return f"/job:{self.job}/task:{self.task}"


DeviceLike = str | DeviceSpec | None


def parse_device(value: DeviceLike) -> DeviceSpec:
    """Coerce a device string, ``DeviceSpec`` or ``None`` to a ``DeviceSpec``."""
    if isinstance(value, DeviceSpec):
        return value
    if value is None or isinstance(value, str):
        return DeviceSpec.from_string(value)
    raise TypeError(f"expected a device string or DeviceSpec, got {type(value).__name__}")


def is_clear(value: object) -> bool:
    """Whether a device value clears the enclosing scopes: ``None`` here, the keyword ``none``
    (any case) in a pipeline file, where an omitted or null ``device`` inherits instead."""
    return isinstance(value, str) and value.strip().lower() == CLEAR


def merge_device(outer: DeviceLike, inner: DeviceLike) -> DeviceSpec:
    """Combine nested device scopes like ``with tf.device(outer): with
    tf.device(inner):``. Fields set in ``inner`` win; unset ones come from
    ``outer`` (``parse_device(outer).make_merged_spec(parse_device(inner))``).
    An empty ``inner`` ("") inherits ``outer``; ``None`` or ``"none"`` clears it,
    like ``tf.device(None)``: the result is the empty spec.
    """
    if inner is None or is_clear(inner):
        return DeviceSpec()
    return parse_device(outer).make_merged_spec(parse_device(inner))
