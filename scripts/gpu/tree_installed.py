"""Check that the fusedhead this Python imports is the tree's: python3 tree_installed.py TREE [--liger].

scripts/gpu/setup_tree.sh runs it after the install. For each of fusedhead (TREE/core),
fusedhead-torch (TREE/plugins/torch_backend) and fusedhead-triton (TREE/plugins/triton_backend),
and fusedhead-liger (TREE/plugins/liger_backend) with --liger: the module imports, its
distribution was installed from that folder of TREE (the distribution's direct_url.json, which pip
writes for a local folder, editable or not), the module is that distribution's (not another
copy earlier on sys.path), and, installed other than editable, its Python files are those of
TREE's src/ folder today (a folder at the same path installed by an earlier call would pass the
other checks). Prints one line a distribution, paths inside TREE relative to it;
exits 1 with the reasons when any check fails, so that a GPU script never measures a fusedhead
left installed by an earlier tree.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

PARTS = [
    ("fusedhead", "fusedhead", "core"),
    ("fusedhead_torch", "fusedhead-torch", "plugins/torch_backend"),
    ("fusedhead_triton", "fusedhead-triton", "plugins/triton_backend"),
]
LIGER = ("fusedhead_liger", "fusedhead-liger", "plugins/liger_backend")


def _within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def check(tree: Path, module: str, dist_name: str, sub: str) -> tuple[str | None, str]:
    """(None, what was found) when ``module`` is ``tree/sub``'s install, else (reason, "")."""
    folder = (tree / sub).resolve()
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # report every kind of import failure, never raise
        return f"import {module} fails: {type(exc).__name__}: {exc}", ""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return f"{module} imports but no {dist_name} distribution is installed", ""
    raw = dist.read_text("direct_url.json")
    info = json.loads(raw) if raw else {}
    url = info.get("url", "")
    source = Path(unquote(urlparse(url).path)).resolve() if url.startswith("file:") else None
    if source != folder:
        where = url or "a wheel or an index (no direct_url.json)"
        return (
            f"{dist_name} {dist.version} is installed from {where}, not from this tree's {sub}",
            "",
        )
    file = Path(mod.__file__ or "").resolve()
    own = {Path(str(dist.locate_file(f))).resolve() for f in dist.files or ()}
    if not (_within(file, folder) or file in own):
        return f"{module} imports from {file}, not from the {dist_name} installed from {sub}", ""
    if info.get("dir_info", {}).get("editable"):
        return None, f"{dist_name} {dist.version}: from this tree's {sub} (editable)"
    differ = _differences(dist, module, folder / "src")
    if differ:
        return (
            f"{dist_name} {dist.version} was installed from this tree's {sub}, but its files are not"
            f" the tree's now ({len(differ)} differ, e.g. {', '.join(differ[:3])}): an earlier"
            " install from the same folder",
            "",
        )
    return None, f"{dist_name} {dist.version}: from this tree's {sub}, its files the tree's"


def _differences(dist: md.Distribution, module: str, src: Path) -> list[str]:
    """The package's Python files that differ between the install and ``src`` (either side)."""
    installed = {
        str(f): Path(str(dist.locate_file(f)))
        for f in dist.files or ()
        if f.parts and f.parts[0] == module and f.suffix == ".py"
    }
    tree = {p.relative_to(src).as_posix(): p for p in (src / module).rglob("*.py") if p.is_file()}
    return sorted(
        name
        for name in installed.keys() | tree.keys()
        if name not in installed
        or name not in tree
        or installed[name].read_bytes() != tree[name].read_bytes()
    )


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--liger"]
    if len(args) != 1:
        print("usage: tree_installed.py TREE [--liger]", file=sys.stderr)
        return 2
    tree = Path(args[0])
    parts = [*PARTS, LIGER] if "--liger" in argv else PARTS
    reasons = []
    for module, dist_name, sub in parts:
        reason, found = check(tree, module, dist_name, sub)
        if reason:
            reasons.append(reason)
        else:
            print(found)
    for reason in reasons:
        print(f"tree_installed: {reason}", file=sys.stderr)
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
