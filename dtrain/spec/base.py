"""What every section of the pipeline builds on: :class:`Strict` (the base model: unknown keys and
booleans-for-numbers refused), the names and bounds the sections share, the "did you mean" helpers
and the device-string checks.

Imports nothing of the sections, so that every section module (``sections``, ``session``,
``data``, ``partitioner``, ``graph``, ``layers``, ``features``) builds on it without a circle."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, model_validator

from .device import DeviceSpec, is_clear
from .errors import CrossFieldErrors

NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"

# Upper bounds: what the runtime can carry out (a timeout becomes a socket option and a
# Future.result deadline; a seed goes to numpy's RandomState through scikit-learn's split; a step
# count stays far from int64's end, where the ps's counters live).
WEEK_S = 7 * 24 * 3600
MAX_STEPS = 2**62
MAX_SEED = 2**32 - 1
MAX_TASKS_PER_JOB = 256
MAX_EMBEDDED_TASKS = 64
MAX_BUCKET_MB = 1024
BOUND_NAMES = {WEEK_S: "one week", MAX_STEPS: "2**62", MAX_SEED: "2**32 - 1: numpy's RandomState, which splits the "
               "data, takes no larger seed"}
"""Bounds that read better named than as numbers, for messages (``messages``)."""


class Strict(BaseModel):
    # allow_inf_nan=False: every float field (nested ones too) refuses .inf and .nan.
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=False, allow_inf_nan=False)

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


def quoted(choices: typing.Iterable[str]) -> str:
    return ", ".join(repr(c) for c in choices)


EXECUTABLE_DEVICE_TYPES = ("CPU", "GPU")


def check_device_type(spec: DeviceSpec, value: str) -> None:
    """Only CPU and GPU exist for dtrain's replicas: any other type (TPU, a typo) would silently
    compute on the CPU, since soft placement falls back from GPU to CPU only."""
    t = spec.device_type
    if t is None or t in EXECUTABLE_DEVICE_TYPES:
        return
    if t.lower() == "cuda":
        raise ValueError(f"{value!r}: a device string names a CUDA device as GPU: write /device:GPU:N or /gpu:N "
                         "(placement.worker_device also takes cuda or cuda:N)")
    raise ValueError(f"{value!r}: device type {t!r} does not exist here; dtrain computes on CPU and GPU only "
                     "(placement.soft falls back from GPU to CPU, never from other types): write /device:CPU:0 "
                     "or /device:GPU:N (/cpu:0, /gpu:N)")


def check_device_string(value: str | None, allow_clear: bool = False) -> str | None:
    """A device string's grammar and type. ``allow_clear``: graph nodes also take ``none``, which
    clears the enclosing scopes like ``tf.device(None)`` (elsewhere a replica's task always applies)."""
    if value is None:
        return None
    if is_clear(value):
        if allow_clear:
            return value
        raise ValueError(f"{value!r} (clear the enclosing device scopes, like tf.device(None)) applies to graph "
                         "variables and ops only; here the replica's (or ps) task always applies: give a device "
                         "string, or leave the key out to inherit")
    check_device_type(DeviceSpec.from_string(value), value)  # from_string raises ValueError with the grammar
    return value
