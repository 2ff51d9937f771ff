"""The chief's shape (docs/architecture.md, "The chief"): the session is built from named roles
and is the only module that holds or changes it. Read from the code itself (its syntax tree), so
a role that starts reaching into the session, or a session that grows a field per feature, fails
here rather than in a review."""

from __future__ import annotations

import ast

from tests.helpers.imports import parse
from tests.helpers.paths import PKG

CHIEF = PKG / "chief"
MAX_SESSION_ATTRIBUTES = 12


def _session_class() -> ast.ClassDef:
    tree = parse((CHIEF / "session.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session")


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Every ``self.NAME`` the class's methods assign (plain, annotated or augmented)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def test_the_session_holds_a_dozen_attributes_at_most():
    """Its roles and the run's state are its fields; the run's many figures live in RunState
    (chief/context.py), not as attributes of the session (fails when one is added there)."""
    attributes = _self_attributes(_session_class())
    assert "ctx" in attributes and "state" in attributes  # (the reader works: the session's own two)
    assert len(attributes) <= MAX_SESSION_ATTRIBUTES, sorted(attributes)


def _mentions_session(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return any(word == "Session" for word in text.replace("[", " ").replace("]", " ").replace("|", " ")
               .replace(".", " ").replace("'", " ").replace('"', " ").split())


def test_no_chief_module_takes_or_reaches_into_the_session():
    """Roles receive what they need by name (the context, the state, the shard group), never the
    session: no parameter of a function outside session.py is a Session (by annotation or by the
    name ``session``), and no module imports it but session.py and runner.py, which builds and runs
    it (fails on a role given ``self``)."""
    offenders = []
    for path in sorted(CHIEF.glob("*.py")):
        if path.name == "session.py":
            continue
        tree = parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for a in args:
                    if a.arg == "session" or _mentions_session(a.annotation):
                        offenders.append(f"{path.name}:{node.lineno}: {node.name}({a.arg})")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("session") \
                    and any(alias.name == "Session" for alias in node.names) and path.name != "runner.py":
                offenders.append(f"{path.name}:{node.lineno}: imports Session")
    assert not offenders, offenders


def test_the_checks_see_a_session_argument():
    """The check above on a function that does take the session (fails if it reads nothing)."""
    code = "def publish(session: 'Session', step: int) -> None: ...\ndef other(s: SessionView) -> None: ..."
    fn, other = parse(code).body
    assert isinstance(fn, ast.FunctionDef) and isinstance(other, ast.FunctionDef)
    assert _mentions_session(fn.args.args[0].annotation) and not _mentions_session(other.args.args[0].annotation)
