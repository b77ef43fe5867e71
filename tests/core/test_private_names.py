"""No module of the core or a backend uses another module's private (``_name``) names.

Parsed with ``ast``, never imported: a private name stays inside the module that defines it; a
name another module needs is public there (its one-line docstring or comment says what it is).
What counts as a use of another module's private name:

- ``from x import _name`` or ``import x._name``, where ``x`` is one of these packages (a private
  submodule, ``pkg/_impl.py``, may be imported inside its own top-level package, and only there);
- ``x._name`` (or ``getattr(x, "_name")``) where ``_name`` is defined by another of these modules
  (a function, class, assignment or attribute it sets) and not by the module that reads it; a
  module's own names read through ``self``/``cls``, and dunder names, are not private uses
  (a ``Protocol``'s stubs of another module's methods define nothing).

Third-party privates (torch's, argparse's, a trainer's) are outside this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Each top-level package's directory: the core's and every backend's.
PACKAGES = [REPO / "core" / "src" / "fusedhead", *sorted(REPO.glob("plugins/*/src/*"))]
PACKAGES = [p for p in PACKAGES if (p / "__init__.py").is_file()]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> dict[str, Path]:
    """Every module of these packages by its dotted name (a package by its ``__init__``'s)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names in ``name`` (a module's dotted name), made absolute."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[name].name == "__init__.py"
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, assignment targets at any depth,
    attributes it sets on any object (``self._x = ...``, ``obj._mark = ...``)."""
    names: set[str] = set()
    # A Protocol's stubs describe another module's object: they define nothing of this one's.
    stubs = {
        id(n)
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and any("Protocol" in ast.unparse(b) for b in c.bases)
        for n in ast.walk(c)
        if n is not c
    }
    for node in ast.walk(tree):
        if id(node) in stubs:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                names.add(str(node.args[1].value))
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {n for n in names if _private(n)}


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
DEFINED = {name: _defined(tree) for name, tree in TREES.items()}


def _owners(attr: str, reader: str) -> list[str]:
    return sorted(m for m, names in DEFINED.items() if attr in names and m != reader)


def _uses(name: str) -> list[str]:
    """Each use, in module ``name``, of a private name another module owns."""
    tree, own = TREES[name], DEFINED[name]
    top = name.split(".")[0]
    rel = MODULES[name].relative_to(REPO)
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom):
            source = _absolute(name, node)
            if source.split(".")[0] not in {p.name for p in PACKAGES}:
                continue
            if any(_private(part) for part in source.split(".")) and source.split(".")[0] != top:
                found.append(f"{where}: from {source} import (a private module)")
            for alias in node.names:
                if not _private(alias.name):
                    continue
                sub = f"{source}.{alias.name}"
                if sub in MODULES and source.split(".")[0] == top:
                    continue  # a private submodule, inside its own package
                found.append(f"{where}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                ours = parts[0] in {p.name for p in PACKAGES}
                if (
                    ours
                    and any(map(_private, parts))
                    and (parts[0] != top or alias.name not in MODULES)
                ):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            attr, base = node.attr, node.value
            if not _private(attr) or attr in own:
                continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            owners = _owners(attr, name)
            if owners:
                found.append(f"{where}: {ast.unparse(node)} (defined in {', '.join(owners)})")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            attr = str(node.args[1].value)
            if _private(attr) and attr not in own and _owners(attr, name):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_the_packages_are_found() -> None:
    names = {p.name for p in PACKAGES}
    assert {"fusedhead", "fusedhead_torch", "fusedhead_triton"} <= names
    assert "fusedhead.head" in MODULES and "fusedhead_triton.launch" in MODULES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_uses_another_modules_private_names(name: str) -> None:
    uses = _uses(name)
    assert not uses, (
        "private names used across modules (make them public, or keep them home):\n"
        + ("\n".join(uses))
    )


def test_the_check_sees_each_kind_of_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: an import of a private name, a module's private attribute and a private
    method read through another object are each caught."""
    source = (
        "from fusedhead_torch.tiling import _probe\n"
        "from fusedhead import head\n"
        "head._secret\n"
        "def f(obj):\n    return obj._helper()\n"
    )
    monkeypatch.setitem(TREES, "fusedhead.probe_mod", ast.parse(source))
    monkeypatch.setitem(MODULES, "fusedhead.probe_mod", REPO / "core/src/fusedhead/probe_mod.py")
    monkeypatch.setitem(DEFINED, "fusedhead.probe_mod", set())
    monkeypatch.setitem(DEFINED, "fusedhead.other_mod", {"_secret", "_helper"})
    uses = _uses("fusedhead.probe_mod")
    assert len(uses) == 3, uses
