"""Every public name the docs show still imports (issue 32: the core's modules were rearranged,
no public name changed).

The names are read from the docs themselves: each ``from fusedhead... import ...`` statement in
README.md, docs/ and the plugins' READMEs, and each dotted ``fusedhead.module.name`` they mention
in backticks; plus ``fusedhead.__all__`` and the names ``fusedhead.api`` has always offered."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS += sorted(ROOT.glob("plugins/*/README.md"))

_IMPORT = re.compile(r"from (fusedhead[\w.]*) import \(?([\w,\s]+?)\)?(?:\n\n|\n(?!\s)|$)")
_DOTTED = re.compile(r"`(fusedhead(?:\.\w+)+)")
#: Entry-point group names the docs show, which read like module paths but are none.
_GROUPS = {"fusedhead.backends", "fusedhead.hooks"}


def _shown() -> set[tuple[str, str]]:
    """(module, name) pairs the docs show."""
    pairs: set[tuple[str, str]] = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in _IMPORT.findall(text):
            for item in names.split(","):
                name = item.split()[0] if item.split() else ""  # `X as Y` imports X
                if name.isidentifier():
                    pairs.add((module, name))
        for dotted in _DOTTED.findall(text):
            if dotted not in _GROUPS:
                pairs.add(tuple(dotted.rsplit(".", 1)))  # type: ignore[arg-type]
    return pairs


API = ["FusedHead", "FusedHeadOutput", "fused_head", "fused_kl", "fused_policy_loss"]
API += ["get_fused_head", "cached_head"]


def test_the_docs_show_names_to_check() -> None:
    shown = _shown()
    assert ("fusedhead", "fused_head") in shown
    assert len(shown) > 20, sorted(shown)


@pytest.mark.parametrize(("module", "name"), sorted(_shown()))
def test_a_name_the_docs_show_imports(module: str, name: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        # `fusedhead.a.b` may be a module `fusedhead.a.b` itself, not a name in `fusedhead.a`
        mod = importlib.import_module(module.rsplit(".", 1)[0])
        name = module.rsplit(".", 1)[1]
    if not hasattr(mod, name):
        importlib.import_module(f"{module}.{name}")  # a submodule shown as a name


@pytest.mark.parametrize("name", sorted(importlib.import_module("fusedhead").__all__))
def test_every_name_of_the_package_imports(name: str) -> None:
    assert getattr(importlib.import_module("fusedhead"), name) is not None


@pytest.mark.parametrize("name", API)
def test_the_api_module_keeps_its_names(name: str) -> None:
    import fusedhead
    from fusedhead import api

    assert callable(getattr(api, name))
    if name in fusedhead.__all__:
        assert getattr(fusedhead, name) is getattr(api, name)


def test_dir_lists_every_public_name_before_its_first_use() -> None:
    """``fusedhead`` imports its public names on first use; ``dir()`` (and so tab completion)
    listed none of them in a fresh interpreter before."""
    import subprocess
    import sys

    code = (
        "import fusedhead, sys; names = dir(fusedhead); "
        "print(sorted(set(fusedhead.__all__) - set(names)), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "False"], out.stdout + out.stderr
