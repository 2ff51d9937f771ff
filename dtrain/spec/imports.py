"""Finding the module of an import path (``model.module``, a custom hook's ``type``) without
importing it: validating a pipeline never executes the user's code.

``importlib.util.find_spec("a.b")`` would import (execute) package ``a`` to read its ``__path__``.
Here each dotted prefix is looked up with the import system's own finders (``sys.meta_path``:
built-in, frozen, the path finder, editable installs), passing the parent's
``submodule_search_locations`` from its *spec*, so no package ``__init__`` runs. A module that
is already imported is taken from ``sys.modules``. Whether the attribute exists, and whether it
is an ``nn.Module`` factory or a ``Hook`` subclass, can only be known by importing: ``dtrain plan``
and ``dtrain run`` check that before anything starts.

A package that rewrites its ``__path__`` at import time (old pkg_resources-style namespaces) may
hide submodules from this search; install such packages as native namespace packages.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["module_of", "missing_module"]


def module_of(path: str) -> str:
    """The module part of ``"pkg.mod:attr"`` (or of ``"pkg.mod.attr"``)."""
    return path.partition(":")[0] if ":" in path else path.rpartition(".")[0]


def _find(name: str, search: list[str] | None) -> Any:
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, search)
        except (ImportError, ValueError, TypeError, AttributeError):
            continue
        if spec is not None:
            return spec
    return None


def missing_module(path: str) -> str | None:
    """Why the module of import path ``path`` cannot be imported here, or None when it can be found.

    Nothing is imported or executed (see the module docstring).
    """
    parts = module_of(path).split(".")
    search: list[str] | None = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)  # imported already (os.path is, though os is no package)
        if loaded is not None:
            locations = getattr(loaded, "__path__", None)
        elif i > 0 and search is None:
            return (f"{parts[i - 1]!r} is a module, not a package, so {name!r} cannot be imported from it; "
                    "write the path as 'package.module:Name'")
        else:
            spec = _find(name, search)
            if spec is None:
                where = "on the Python path (sys.path)" if i == 0 else f"in package {'.'.join(parts[:i])!r}"
                return (f"cannot find module {name!r} of {path!r} {where}; install the package that provides it, "
                        "add its directory to PYTHONPATH, or correct the name (validation only looks for the module: "
                        "it never imports it)")
            locations = spec.submodule_search_locations
        search = list(locations) if locations is not None else None
    return None
