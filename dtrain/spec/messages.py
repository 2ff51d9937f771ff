"""pydantic's validation errors -> one message per problem, in the user's words: the bad
value, the allowed values (with a "did you mean"), and the fix.

A message that names allowed keys, values or tags finds them by walking the error's location
from a root model the caller passes in: ``PipelineSpec`` for a whole pipeline file (``loading``),
a section model for a part of a section validated on its own (``elastic_jobs``). So this module
knows no section: every section module may word its problems with it.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from .base import BOUND_NAMES, did_you_mean, quoted

Loc = tuple[str | int, ...]  # a pydantic error's location

_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "list_type": "a list", "tuple_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
    "literal_error": "one of the allowed values",
}

_BOUNDS = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"), "less_than": ("<", "lt"),
           "less_than_equal": ("<=", "le")}

# Names from other frameworks, for 'did you mean' when plain spelling similarity does not find them.
_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "units": "out",
            "out_features": "out", "features": "out", "filters": "out", "out_channels": "out",
            "kernel": "kernel_size", "activation": "type", "optimiser": "optimizer", "layer": "layers",
            "devices": "device", "ps_tasks": "jobs", "cluster_spec": "jobs"}


def union_messages(errs: list[tuple[ErrorDetails, Loc, bool]], root: type[BaseModel]) -> list[str]:
    """One value's errors from several union branches (``int | list[str]``, ...): what was expected."""
    # A branch whose type matched but whose constraint failed says the most (ps: 0 -> ">= 1").
    specific = [e for e, _, _ in errs if e["type"] not in _EXPECTED]
    if specific:
        return [error_message(e, (), root) for e in specific]
    expected: list[str] = []
    for e, _, _ in errs:
        what = _EXPECTED[e["type"]]
        if what not in expected:
            expected.append(what)
    return [f"expected {' or '.join(expected)}, got {_show(errs[0][0].get('input'))}"]


def _show(value: Any) -> str:
    if value is None:
        return "an empty value (null)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def error_message(err: ErrorDetails, loc: Loc, root: type[BaseModel]) -> str:
    """The message of one error at ``loc``, a location within ``root`` (the model validated)."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind == "extra_forbidden":
        key = str(loc[-1])
        allowed = _allowed_keys(loc[:-1], root)
        alias = _ALIASES.get(key)
        hint = f"; did you mean {alias!r}?" if alias in allowed else did_you_mean(key, allowed)
        msg = f"unknown key {key!r}{hint}"
        return msg + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    if kind == "missing" and loc and isinstance(loc[-1], int):
        info = _field_at(loc[:-1], root)
        args = typing.get_args(info.annotation) if info is not None else ()
        n = f"{len(args)} values" if args and Ellipsis not in args else "more values"
        return f"expected {n}, got only {loc[-1]}"
    if kind == "missing":
        key = str(loc[-1]) if loc else "?"
        info = _field_at(loc, root)
        what = f" ({info.description.rstrip('.')})" if info is not None and info.description else ""
        return f"missing required key {key!r}{what}"
    if kind == "literal_error":
        choices = _literal_choices(loc, root) or [
            c.strip().strip("'") for c in str(ctx.get("expected", "")).replace(" or ", ", ").split(",")]
        return f"{_show(value)} is not one of {quoted(choices)}{did_you_mean(value, choices)}"
    if kind == "union_tag_invalid":
        tag = ctx.get("tag")
        choices = [c.strip().strip("'") for c in str(ctx.get("expected_tags", "")).split(",")]
        what = "layer type" if "type" in str(ctx.get("discriminator")) else "optimizer"
        what = "partitioner type" if "partitioner" in loc else what
        return f"unknown {what} {tag!r}{did_you_mean(tag, choices)} (known: {', '.join(choices)})"
    if kind == "union_tag_not_found":
        key = str(ctx.get("discriminator", "tag")).strip("'")
        choices = _union_tags(loc, root)
        what = "the layer type" if key == "type" else "the optimizer"
        what = "the partitioner type" if "partitioner" in loc else what
        return f"missing required key {key!r}: {what}, one of {', '.join(choices)}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if kind in _BOUNDS:
        op, name = _BOUNDS[kind]
        bound = ctx.get(name)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        named = f" ({BOUND_NAMES[bound]})" if bound in BOUND_NAMES else ""
        return f"must be {op} {bound}{named}, got {_show(value)}"
    if kind in ("too_short", "too_long"):
        length = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"needs {'at least' if kind == 'too_short' else 'at most'} {length} item(s), got {_show(value)}"
    if kind == "string_pattern_mismatch":
        return f"{_show(value)} must be letters, digits, '_', '.' or '-' (and not start with '.' or '-')"
    if kind in _EXPECTED:
        what = _EXPECTED[kind]
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            what = "a mapping of settings (key: value lines, or {key: value, ...})"
        if kind == "int_from_float":
            return f"expected a whole number, got {_show(value)}"
        if kind == "int_parsing" and isinstance(value, str) and _scientific(value) is not None:
            return (f"expected an integer, got the string {value!r}: YAML reads a number in e-notation without "
                    f"a '.' (like 1e12) as a string; write the integer out: {_scientific(value)}")
        return f"expected {what}, got {_show(value)}"
    return f"{err['msg']} (got {_show(value)})"


def _scientific(text: str) -> str | None:
    """``"1e12"`` -> ``"1000000000000"``: the integer a string in e-notation means, if it is one."""
    try:
        number = float(text)
    except ValueError:
        return None
    if "e" not in text.lower() or not number.is_integer():
        return None
    return str(int(number))


# ------------------------------------------------------------------- the models behind a location


def _models_at(loc: Loc, root: type[BaseModel]) -> list[Any]:
    """Annotations found at ``loc`` walking from ``root`` (several for a union)."""
    candidates: list[Any] = [root]
    for part in loc:
        nxt: list[Any] = []
        for c in _expand(candidates):
            if isinstance(c, type) and issubclass(c, BaseModel):
                if isinstance(part, str) and part in _tags_of(c):
                    nxt.append(c)  # a union branch tag: stay on this model
                elif isinstance(part, str) and part in c.model_fields:
                    nxt.append(c.model_fields[part].annotation)
            elif typing.get_origin(c) in (list, tuple) and isinstance(part, int):
                nxt.extend(typing.get_args(c)[:1])
            elif typing.get_origin(c) is dict and isinstance(part, str):
                nxt.extend(typing.get_args(c)[1:2])
        candidates = nxt or candidates
    return _expand(candidates)


def _allowed_keys(loc: Loc, root: type[BaseModel]) -> list[str]:
    """Field names of the model found at ``loc``, for 'did you mean'."""
    fields: list[str] = []
    for c in _models_at(loc, root):
        if isinstance(c, type) and issubclass(c, BaseModel):
            fields.extend(f for f in c.model_fields if f not in fields)
    return fields


def _field_at(loc: Loc, root: type[BaseModel]) -> Any:
    if not loc:
        return None
    for c in _models_at(loc[:-1], root):
        if isinstance(c, type) and issubclass(c, BaseModel) and str(loc[-1]) in c.model_fields:
            return c.model_fields[str(loc[-1])]
    return None


def _literal_choices(loc: Loc, root: type[BaseModel]) -> list[str]:
    info = _field_at(loc, root)
    choices: list[str] = []
    for arg in _expand([info.annotation] if info is not None else []):
        if typing.get_origin(arg) is typing.Literal:
            choices.extend(str(a) for a in typing.get_args(arg))
    return choices


def _union_tags(loc: Loc, root: type[BaseModel]) -> list[str]:
    tags: list[str] = []
    for c in _models_at(loc, root):
        if isinstance(c, type) and issubclass(c, BaseModel):
            tags.extend(t for t in _tags_of(c) if t not in tags)
    return tags


def _expand(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        origin = typing.get_origin(item)
        if origin is typing.Annotated:
            out.extend(_expand([typing.get_args(item)[0]]))
        elif origin is typing.Union or origin is types.UnionType:
            out.extend(_expand(list(typing.get_args(item))))
        else:
            out.append(item)
    return out


def member_tags(*unions: Any) -> frozenset[str]:
    """The tags of discriminated unions' members (a layer's ``type``, an optimizer's ``name``): what
    pydantic puts into the ``loc`` of an error in such a member."""
    return frozenset(t for c in _expand(list(unions)) for t in _tags_of(c))


def _tags_of(cls: type[BaseModel]) -> tuple[str, ...]:
    """The discriminator values of a union member (a layer's ``type``, an optimizer's ``name``)."""
    for key in ("type", "name"):
        f = cls.model_fields.get(key)
        if f is not None and typing.get_origin(f.annotation) is typing.Literal:
            return tuple(str(a) for a in typing.get_args(f.annotation))
    return ()
