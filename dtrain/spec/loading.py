"""YAML -> PipelineSpec, with every error located at ``FILE:LINE: dotted.path``.

The file is parsed once with PyYAML's *safe* loader into a node tree (which carries line numbers)
and constructed from that tree into plain data for pydantic; ``!!python/...`` tags are refused.
A pydantic error's ``loc`` is walked through the data to find the dotted path the user wrote
(union tags such as a layer type are dropped), and the path through the node tree to find the line:

- an unknown key: the key's line;
- a missing key: the line of the key of the mapping that lacks it (``model:``);
- a bad scalar value: the value's line;
- a bad mapping or list: the line of its key (or, for a list item, of the item).

Problems come back sorted by line, one per line of output.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .errors import CrossFieldErrors, Problem, SpecError, dotted
from .layers import Layer
from .messages import error_message, member_tags, union_messages
from .partitioner import PartitionerSpec
from .pipeline import PipelineSpec
from .sections import OptimizerSpec

__all__ = ["load", "loads", "locate", "validate"]


def load(path: str | Path, overrides: list[str] | None = None, *, scheduler: str | None = None) -> PipelineSpec:
    """Read and validate a pipeline file. Raises :class:`SpecError` listing every problem.

    ``overrides`` are ``KEY=VALUE`` strings (``training.steps=50``, ``hooks.0.every_steps=10``),
    applied to the parsed file before validation, as ``dtrain run --set`` does; each VALUE is
    parsed as YAML. Relative data paths are resolved against the file's directory. ``scheduler``
    (``dtrain run --scheduler``) says the tasks are served by a running cluster, not embedded.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([Problem("file not found", file=str(path), line=1)]) from None
    except IsADirectoryError:
        raise SpecError([Problem("is a directory, not a pipeline file", file=str(path), line=1)]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([Problem(f"not UTF-8 text: {exc}", file=str(path), line=1)]) from None
    except OSError as exc:
        raise SpecError([Problem(f"cannot read: {exc.strerror or exc}", file=str(path), line=1)]) from None
    return loads(text, filename=str(path), base_dir=path.resolve().parent, overrides=overrides, scheduler=scheduler)


def loads(text: str, filename: str = "<string>", base_dir: str | Path = ".",
          overrides: list[str] | None = None, *, scheduler: str | None = None) -> PipelineSpec:
    """Validate pipeline YAML given as a string (see :func:`load`); ``base_dir`` anchors relative data paths."""
    node, data = _parse(text, filename)
    if node is None or data is None:
        raise SpecError([Problem("the file is empty; a pipeline needs at least a 'model' or a 'graph' section "
                                 "(see pipelines/ for examples)", file=filename, line=1)])
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
            type(data), type(data).__name__)
        raise SpecError([Problem(f"the top level must be a mapping of sections (name:, cluster:, model:, ...), "
                                 f"not a {kind}", file=filename, line=node.start_mark.line + 1)])
    _check_aliases(node, filename)  # before anything walks the tree with its aliases expanded
    duplicates = _duplicate_keys(node, filename)
    applied: dict[tuple[str, ...], str] = {}
    for item in overrides or []:
        applied[_apply_override(data, item, filename)] = item
    try:
        spec = validate(data, filename=filename, base_dir=base_dir, node=node, overrides=applied, scheduler=scheduler)
    except SpecError as exc:
        raise SpecError(_sorted(duplicates + exc.problems)) from None
    if duplicates:
        raise SpecError(duplicates)
    return spec


def validate(data: dict[str, Any], filename: str = "<spec>", base_dir: str | Path = ".",
             node: yaml.Node | None = None, overrides: dict[tuple[str, ...], str] | None = None,
             scheduler: str | None = None) -> PipelineSpec:
    """Validate already-parsed data; ``node`` (the YAML node tree) gives problems their lines."""
    try:
        return PipelineSpec.model_validate(data, context={"base_dir": str(base_dir), "scheduler": scheduler})
    except ValidationError as exc:
        raise SpecError(_problems(exc, filename, data, node, overrides or {})) from None


def locate(error: SpecError, path: str | Path, overrides: list[str] | None = None) -> SpecError:
    """``error`` with a file and line for each problem that has none: problems found after loading
    (``dtrain plan``/``run`` import the user's code and read the data) name only a dotted path."""
    try:
        node, _ = _parse(Path(path).read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, SpecError):
        node = None
    applied = {tuple(p.strip() for p in item.split("=", 1)[0].split(".")): item for item in overrides or []}
    problems = [p if p.file is not None else _locate(_undotted(p.path), p.message, str(path), node, applied)
                for p in error.problems]
    return SpecError(_sorted(problems))


def _undotted(path: str) -> list[str | int]:
    """``"hooks[1].type"`` -> ``["hooks", 1, "type"]`` (the inverse of ``dotted``)."""
    out: list[str | int] = []
    for part in path.split(".") if path else []:
        name, *indices = part.split("[")
        if name:
            out.append(name)
        out.extend(int(i.rstrip("]")) for i in indices if i.rstrip("]").isdigit())
    return out


# ---------------------------------------------------------------------------------------- parsing


def _parse(text: str, filename: str) -> tuple[yaml.Node | None, Any]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.constructor.ConstructorError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 1
        problem = (exc.problem or "").replace("tag:yaml.org,2002:", "!!")
        if "could not determine a constructor for the tag" in problem:
            tag = problem.split("tag", 1)[1].strip().strip("'\"")
            msg = (f"YAML tag {tag!r} is not allowed: pipeline files are plain data, read with the safe loader "
                   "(no Python objects); remove the tag")
        else:
            msg = f"YAML error: {' '.join(x for x in (exc.context, problem) if x)}"
        raise SpecError([Problem(msg, file=filename, line=line)]) from None
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_syntax_problem(exc, filename)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Problem(f"YAML error: {exc}", file=filename, line=1)]) from None
    except RecursionError:
        raise SpecError([Problem("YAML nests too deeply (hundreds of levels of lists or mappings): a pipeline file "
                                 "is a few levels deep; check the brackets", file=filename, line=1)]) from None
    finally:
        loader.dispose()
    return node, data


def _syntax_problem(exc: yaml.MarkedYAMLError, filename: str) -> Problem:
    problem = exc.problem or "invalid YAML"
    context = exc.context or ""
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else 1
    if "'\\t'" in problem:
        return Problem("YAML syntax error: a tab character; YAML indents with spaces only, replace the tab with spaces",
                       file=filename, line=line)
    opened = exc.context_mark
    if opened is not None and any(c in context for c in ("flow sequence", "flow mapping", "quoted scalar")):
        # An unclosed bracket, brace or quote: the opening one is the node at fault; the parser
        # only notices where the collection should have ended.
        what = "quote" if "quoted" in context else ("'['" if "sequence" in context else "'{'")
        return Problem(f"YAML syntax error: the {what} opened here is not closed ({problem} at line "
                       f"{line}, column {mark.column + 1 if mark else '?'})", file=filename, line=opened.line + 1)
    if "block" in context and mark is not None:
        return Problem(f"YAML syntax error: bad indentation: this line (indented {mark.column} space(s)) does not "
                       "line up with the lines above it; keys of one mapping, and items of one list, must start "
                       "in the same column", file=filename, line=line)
    hint = ""
    if "single document" in context:
        hint = "; a pipeline file holds one YAML document: remove the '---' line"
    elif "<stream end>" in problem:
        hint = "; the file ends inside an unclosed '[', '{' or quote"
    elif "mapping values are not allowed" in problem:
        hint = "; a 'key: value' cannot follow a plain value on one line (check the indentation, or quote the value)"
    text = f"{context} {problem}".strip() if context else problem
    return Problem(f"YAML syntax error: {text}{hint}", file=filename, line=line)


MAX_ALIAS_NODES = 10_000
"""How many YAML nodes aliases may add to a file (each use of ``*name`` counts its anchor's nodes)."""


def _check_aliases(node: yaml.Node, filename: str) -> None:
    """Refuse alias bombs and recursive aliases before anything expands them.

    Anchors and aliases stay allowed (``<<: *defaults`` is a common way to share settings), but
    PyYAML composes an alias as the anchored node itself, so a tree of aliases of aliases is a
    small file that expands exponentially in every walk over it (duplicate keys, validation,
    ``pipeline_hash``): ten nested levels of nine aliases are billions of nodes. Each node's
    expanded size is counted once (memoised), so this check is linear in the file's size.
    """
    sizes: dict[int, int] = {}
    uses: dict[int, int] = {}
    active: set[int] = set()
    nodes: dict[int, yaml.Node] = {}

    def size(n: yaml.Node) -> int:
        key = id(n)
        uses[key] = uses.get(key, 0) + 1
        if key in sizes:
            return sizes[key]
        if key in active:
            raise SpecError([Problem("YAML alias refers to a node that contains it (a recursive alias): a pipeline "
                                     "is a tree; write the value out instead of the alias",
                                     file=filename, line=n.start_mark.line + 1)])
        active.add(key)
        nodes[key] = n
        total = 1
        if isinstance(n, yaml.SequenceNode):
            total += sum(size(item) for item in n.value)
        elif isinstance(n, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in n.value)
        active.discard(key)
        sizes[key] = total
        return total

    total = size(node)
    if total - len(sizes) > MAX_ALIAS_NODES:
        # The anchor whose uses add the most nodes is the one to point at.
        key = max((k for k in sizes if uses[k] > 1), key=lambda k: sizes[k] * (uses[k] - 1))
        raise SpecError([Problem(f"YAML aliases expand this file to {total} nodes ({total - len(sizes)} beyond the "
                                 f"file's own {len(sizes)}; at most {MAX_ALIAS_NODES} may be added by aliases): an "
                                 "alias bomb or far too many uses of an anchor; write the values out or use fewer "
                                 "aliases (the anchor on this line adds the most)",
                                 file=filename, line=nodes[key].start_mark.line + 1)])


def _duplicate_keys(node: yaml.Node, filename: str) -> list[Problem]:
    """PyYAML keeps the last of repeated keys silently; a pipeline with a repeated key is ambiguous."""
    problems: list[Problem] = []

    def walk(n: yaml.Node, path: list[str | int]) -> None:
        if isinstance(n, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in n.value:
                # Constructing the data flattened merge keys (<<: *anchor) into this node: the merged
                # pairs are the anchor's own nodes, from outside this mapping, and may be overridden.
                merged = not n.start_mark.index <= k.start_mark.index < n.end_mark.index
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge" and not merged:
                    line = k.start_mark.line + 1
                    if k.value in first:
                        problems.append(Problem(f"duplicate key {k.value!r} (first at line {first[k.value]}); "
                                                "YAML would keep only the last one: remove or merge them",
                                                path=dotted([*path, k.value]), file=filename, line=line))
                    else:
                        first[k.value] = line
                    walk(v, [*path, k.value])
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                walk(item, [*path, i])

    walk(node, [])
    return problems


def _apply_override(data: dict[str, Any], item: str, filename: str) -> tuple[str, ...]:
    def fail(why: str) -> SpecError:
        return SpecError([Problem(f"--set {item!r}: {why}", file=filename, line=1)])

    if "=" not in item:
        raise fail("write KEY=VALUE, e.g. --set training.steps=50")
    key, raw = item.split("=", 1)
    parts = tuple(p.strip() for p in key.strip().split("."))
    if not key.strip() or any(not p for p in parts):
        raise fail("KEY must be a dotted path such as training.steps or hooks.0.every_steps")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise fail(f"VALUE is not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    cur: Any = data
    for depth, p in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "the top level"
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise fail(f"{where} is a list of {len(cur)}; {p!r} is not an index into it")
            if last:
                cur[int(p)] = value
            else:
                cur = cur[int(p)]
        elif isinstance(cur, dict):
            if last:
                cur[p] = value
            else:
                if cur.get(p) is None:
                    cur[p] = {}
                cur = cur[p]
        else:
            raise fail(f"{where} is a value ({cur!r}), not a section; it has no key {p!r}")
    return parts


# ------------------------------------------------------------------------------ error -> location


def _problems(exc: ValidationError, filename: str, data: Any, node: yaml.Node | None,
              overrides: dict[tuple[str, ...], str]) -> list[Problem]:
    problems: list[Problem] = []
    # Errors of one value from several union branches (int | list[str], ...) become one message.
    groups: dict[tuple[str | int, ...], list[tuple[ErrorDetails, tuple[str | int, ...], bool]]] = {}
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, CrossFieldErrors):
            for rel, msg in inner.problems:
                found, _ = _data_path(loc + tuple(rel), data, keep_last=True)
                problems.append(_locate(found, msg, filename, node, overrides))
            continue
        path, dropped = _data_path(loc, data, keep_last=err["type"] in ("missing", "extra_forbidden"))
        groups.setdefault(tuple(path), []).append((err, loc, dropped))
    for key, errs in groups.items():
        if len(errs) > 1 and all(dropped for _, _, dropped in errs):
            for msg in union_messages(errs, PipelineSpec):
                problems.append(_locate(list(key), msg, filename, node, overrides))
            continue
        for err, loc, _ in errs:
            message = error_message(err, loc, PipelineSpec)
            at = list(key)
            if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
                at.append(str(err["ctx"]["discriminator"]).strip("'"))
            problems.append(_locate(at, message, filename, node, overrides))
    return _sorted(problems)


def _sorted(problems: list[Problem]) -> list[Problem]:
    """File order, without repeats."""
    seen: set[str] = set()
    unique = []
    for p in sorted(problems, key=lambda p: (p.line or 0, p.column or 0, p.path)):
        if str(p) not in seen:
            seen.add(str(p))
            unique.append(p)
    return unique


def _locate(path: list[str | int], message: str, filename: str, node: yaml.Node | None,
            overrides: dict[tuple[str, ...], str]) -> Problem:
    for key, item in overrides.items():
        parts = tuple(str(p) for p in path)
        if parts[: len(key)] == key or (parts and parts == key[: len(parts)]):
            message = f"{message} (from --set {item})"
            break
    line, column = _position(path, node)
    return Problem(message, path=dotted(path), file=filename, line=line, column=column)


@functools.cache
def _discriminated() -> frozenset[str]:
    """Every layer type, optimizer and partitioner name: the tags pydantic puts into a union member's ``loc``."""
    return member_tags(Layer, OptimizerSpec, PartitionerSpec)


def _data_path(loc: tuple[str | int, ...], data: Any, keep_last: bool) -> tuple[list[str | int], bool]:
    """The path of a pydantic ``loc`` in the user's data, and whether parts were dropped.

    pydantic's ``loc`` also names union branches (``'linear'``, ``'int'``, ``'list[str]'``,
    ``'function-after[...]'``): any part the data does not contain is such a tag, except the
    last one of a missing or unknown key.
    """
    out: list[str | int] = []
    dropped = False
    cur = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(cur, dict):
            is_tag = (not last and isinstance(part, str) and part in _discriminated()
                      and part in (cur.get("type"), cur.get("name")))
            if not is_tag and part in cur:
                out.append(part)
                cur = cur[part]
                continue
            if not is_tag and last and keep_last:
                out.append(part)
                continue
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            out.append(part)
            cur = cur[part]
            continue
        elif cur is None and isinstance(part, (str, int)) and keep_last and last:
            out.append(part)
            continue
        dropped = True
    return out, dropped


def _position(path: list[str | int], node: yaml.Node | None) -> tuple[int, int]:
    """(line, column), 1-based, of the node at ``path``; of its nearest ancestor when absent."""
    if node is None:
        return 1, 1
    cur = node
    mark = node.start_mark
    for part in path:
        if isinstance(cur, yaml.MappingNode):
            found = None
            for k, v in cur.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    found = (k, v)
            if found is None:
                break
            mark = found[0].start_mark
            cur = found[1]
        elif isinstance(cur, yaml.SequenceNode) and isinstance(part, int) and part < len(cur.value):
            cur = cur.value[part]
            mark = cur.start_mark
        else:
            break
    else:
        if isinstance(cur, yaml.ScalarNode):
            mark = cur.start_mark  # a bad value: its own line (it may sit below its key)
    return mark.line + 1, mark.column + 1
