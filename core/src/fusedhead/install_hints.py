"""What to install: the command for a first-party backend, true for how fusedhead is published,
and the triage of a backend's failed import (its own install broken, or which dependency is
missing).

A leaf module: the registry's errors and ``fusedhead list`` name these commands.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import urllib.parse
import urllib.request
from typing import Any

from fusedhead.errors import BackendLoadError, MissingDependencyError

#: First-party backends and the extra that installs each.
FIRST_PARTY_EXTRAS = {
    "torch": "fusedhead[torch]",
    "triton": "fusedhead[triton]",
    "liger": "fusedhead[liger]",
}
#: Where each first-party backend's project lives in a clone of the repository.
FIRST_PARTY_SOURCES = {
    "torch": "plugins/torch_backend",
    "triton": "plugins/triton_backend",
    "liger": "plugins/liger_backend",
}
#: Whether the first-party distributions are published on PyPI. Until they are, a bare
#: ``pip install 'fusedhead[triton]'`` finds no fusedhead-triton, so :func:`install_command`
#: names what works from a clone instead; docs/releasing.md (step 6) sets it after the first upload.
ON_PYPI = False


def source_checkout() -> str | None:
    """The clone the core was installed from (``pip install [-e] ./core``), if it is still there.

    Read from the core's PEP 610 ``direct_url.json``; None for an install from wheels or an index.
    """
    try:
        text = md.distribution("fusedhead").read_text("direct_url.json")
        url = json.loads(text or "{}").get("url", "")
    except (md.PackageNotFoundError, ValueError, AttributeError, OSError):
        return None
    if not isinstance(url, str) or not url.startswith("file:"):
        return None
    core = urllib.request.url2pathname(urllib.parse.urlparse(url).path).rstrip("/")
    root = os.path.dirname(core)
    return root if os.path.isfile(os.path.join(root, "core", "pyproject.toml")) else None


def install_command(name: str) -> str:
    """The pip command that installs first-party backend ``name``, true for how it is published.

    ``pip install 'fusedhead[NAME]'`` once the distributions are on PyPI; until then the backend's
    folder in the clone the core came from, or a clone and the wheels ``scripts/build-dists`` makes.
    """
    extra = FIRST_PARTY_EXTRAS[name]
    if ON_PYPI:
        return f"pip install '{extra}'"
    source = FIRST_PARTY_SOURCES[name]
    root = source_checkout()
    if root is not None and os.path.isfile(os.path.join(root, source, "pyproject.toml")):
        return f"pip install '{os.path.join(root, source)}' (fusedhead is not on PyPI yet)"
    return (
        f"from a clone of the fusedhead repository (it is not on PyPI yet), pip install ./{source}, "
        f"or pip install --find-links dist '{extra}' with the wheels that scripts/build-dists "
        "built in dist/"
    )


def extra_command(extra: str) -> str:
    """The pip command that installs what the core's extra ``extra`` adds (``testing``, ``yaml``,
    ``bench``, ``transformers``): ``pip install 'fusedhead[EXTRA]'`` once fusedhead is on PyPI;
    until then the extra's own requirements, read from the core's metadata (a bare
    ``fusedhead[EXTRA]`` would look for fusedhead on the index)."""
    if ON_PYPI:
        return f"pip install 'fusedhead[{extra}]'"
    marker = re.compile(rf"""\s*;\s*extra\s*==\s*['"]{re.escape(extra)}['"]\s*$""")
    try:
        requires = md.distribution("fusedhead").requires or []
    except (md.PackageNotFoundError, ValueError, OSError):
        requires = []
    wanted = [marker.sub("", r) for r in requires if marker.search(r)]
    if not wanted:
        return f"pip install 'fusedhead[{extra}]'"
    return "pip install " + " ".join(f"'{r}'" for r in wanted)


def normalize(dist_name: str) -> str:
    """A distribution name normalized (PEP 503), for comparing names."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def import_error(cand: Any, exc: ImportError, fields: dict[str, Any]) -> Exception:
    """A missing module becomes ``MissingDependencyError`` (a third-party package) or
    ``BackendLoadError`` (the plugin's own module: its install is broken or stale); a missing
    name, ``BackendLoadError``.

    Never ``pip install <import name>``: an import name is not a pip name (``yaml`` is PyYAML,
    ``cv2`` opencv-python) and the plugin's own package name on an index may be anyone's. A pip
    package is named only where the distribution's own Requires-Dist names it. ``cand``: the
    registry's ``Candidate``; ``fields``: the identity its errors carry.
    """
    dist = cand.distribution or "the backend's distribution"
    reinstall = (
        install_command(cand.name) if cand.name in FIRST_PARTY_EXTRAS else f"reinstall {dist}"
    )
    missing = getattr(exc, "name", None)
    top = missing.split(".")[0] if missing else None
    if isinstance(exc, ModuleNotFoundError) and missing and top:
        module = cand.entry_point.module if cand.entry_point is not None else ""
        if top == module.split(".")[0]:  # the entry point's own module or its package
            return BackendLoadError(
                f"could not be imported: its own module {missing!r} (of the entry point "
                f"{cand.value}) is not installed, so the install of {dist} is broken or stale "
                f"({exc})",
                hint=f"{reinstall} (uninstall it first if reinstalling does not help)",
                **fields,
            )
        try:
            present = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            present = False
        if not present:
            required = _required_as(cand.distribution, top)
            if required:
                why = f"a dependency of {dist}"
                hint = (
                    f"pip install '{required}' (its Requires-Dist), or {reinstall} with its "
                    "dependencies"
                )
            else:  # declared under another pip name (yaml: PyYAML), or not declared at all
                why = (
                    f"{dist} imports it; its Requires-Dist names no distribution {top!r}: a "
                    "dependency under another name, or one it does not declare"
                )
                hint = (
                    f"{reinstall} with its dependencies; if {top!r} is still missing, install "
                    f"the package that provides it (its pip name may differ) and report the "
                    f"missing requirement to the authors of {dist}"
                )
            return MissingDependencyError(
                f"could not be imported: the module {top!r} is not installed ({why}) ({exc})",
                missing=top,
                hint=hint,
                **fields,
            )
    own = (cand.entry_point.module if cand.entry_point is not None else "").split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) and top and top == own:
        # a name its own package lacks: its own code or its install, nothing else installed
        return BackendLoadError(
            f"could not be imported: {exc} (a name its own package {top!r} lacks: the install "
            f"of {dist} is broken or stale, or its code is wrong)",
            hint=f"{reinstall}; if the error stays, report it to the authors of {dist}",
            **fields,
        )
    if not isinstance(exc, ModuleNotFoundError) and top and top not in ("fusedhead", own):
        required = _required_as(cand.distribution, top)
        return BackendLoadError(
            f"could not be imported: {exc} (the installed {top!r} lacks a name {dist} uses: "
            "not the version it was built for)",
            hint=f"pip install '{required}' (its Requires-Dist)"
            if required
            else f"install the version of {top!r} that {dist} needs, or {reinstall} with its "
            "dependencies",
            **fields,
        )
    return BackendLoadError(
        f"could not be imported: {type(exc).__name__}: {exc}",
        hint=f"the installed packages do not match what {cand.distribution or 'the backend'} was "
        f"built for; upgrade fusedhead and the backend together, or {reinstall}",
        **fields,
    )


def _required_as(distribution: str | None, module: str) -> str | None:
    """The requirement (name and version, no marker) in ``distribution``'s Requires-Dist whose
    name is import name ``module`` (normalized), or None: only then is the pip name known."""
    if distribution is None:
        return None
    try:
        requires = md.distribution(distribution).requires or []
    except (md.PackageNotFoundError, ValueError, OSError):
        return None
    for req in requires:
        spec = req.split(";", 1)[0].strip()
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
        if name and normalize(name.group(0)) == normalize(module):
            return re.sub(r"\[.*?\]", "", spec)
    return None
