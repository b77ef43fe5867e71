"""How to install a first-party backend, true for how fusedhead is published.

A leaf module: the registry's errors and ``fusedhead list`` name these commands.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import urllib.parse
import urllib.request

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
