"""Packaging: what each built wheel declares, read as pip and PyPI read it.

Builds the ten files with ``scripts/build-dists OUT --no-check`` (seconds, no venv) and checks
each wheel's METADATA against the code it carries: every third-party module a package imports is
declared (a stranger's ``pip install`` must bring it), the classifiers say the package is typed and
name only Python versions that Requires-Python admits.
"""

from __future__ import annotations

import ast
import email
import email.message
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from dist_layout import DISTS, REPO, SCRIPT
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

#: import name -> the distribution that provides it
PROVIDER = {
    "fusedhead": "fusedhead",
    "torch": "torch",
    "triton": "triton",
    "pydantic": "pydantic",
    "pluggy": "pluggy",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "matplotlib": "matplotlib",
    "transformers": "transformers",
    "packaging": "packaging",
    "liger_kernel": "liger-kernel",
}
#: Imports the core leaves to the user on purpose, each with the reason.
CORE_UNDECLARED = {
    "torch": "installed first, the build the user wants (README: torch first)",
    "triton": "fusedhead bench's CUDA timer; comes with a CUDA torch or fusedhead[triton]",
    "packaging": "the TRL integration only; transformers requires it",
    "accelerate": "the TRL integration's fused loss only (TRL's own gather); TRL requires it",
    "omegaconf": "FusedHeadConfig.from_omegaconf takes the user's own OmegaConf object",
    "verl": "an integration of the trainer the user runs",
    "veomni": "an integration of the trainer the user runs",
    "trl": "an integration of the trainer the user runs",
    "openrlhf": "an integration of the trainer the user runs",
}

pytestmark = pytest.mark.packaging


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, SCRIPT, out, "--no-check"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = {}
    for dist in DISTS:
        (wheel,) = out.glob(f"{dist.replace('-', '_')}-*.whl")
        found[dist] = wheel
    return found


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_string(z.read(name).decode())


def requirements(meta: email.message.Message) -> tuple[set[str], set[str]]:
    """(distributions required always, distributions some extra requires)."""
    always, extra = set(), set()
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if req.marker is not None and "extra" in str(req.marker):
            extra.add(name)
        else:
            always.add(name)
    return always, extra


def third_party_imports(wheel: Path, package: str) -> dict[str, set[str]]:
    """Top-level module -> the wheel's files importing it (absolute imports, stdlib left out)."""
    found: dict[str, set[str]] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not (name.startswith(package + "/") and name.endswith(".py")):
                continue
            for node in ast.walk(ast.parse(z.read(name), name)):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if top not in sys.stdlib_module_names and top != package:
                        found.setdefault(top, set()).add(name)
    return found


@pytest.mark.parametrize("dist", list(DISTS))
def test_every_import_is_declared(wheels: dict[str, Path], dist: str) -> None:
    """A backend needs what it imports in its dependencies; the core at least in an extra."""
    meta = metadata(wheels[dist])
    always, extra = requirements(meta)
    undeclared = {}
    for module, files in third_party_imports(wheels[dist], DISTS[dist][1]).items():
        if dist == "fusedhead" and module in CORE_UNDECLARED:
            continue
        provider = PROVIDER.get(module)
        declared = always if dist != "fusedhead" else always | extra
        if provider is None or canonicalize_name(provider) not in declared:
            undeclared[module] = sorted(files)
    assert not undeclared, f"{dist} imports without declaring them: {undeclared}"


def test_core_testing_extra_brings_numpy(wheels: dict[str, Path]) -> None:
    """fusedhead.testing.interpreter imports NumPy: `fusedhead[testing]` must install it."""
    lines = metadata(wheels["fusedhead"]).get_all("Requires-Dist") or []
    testing = {
        canonicalize_name(Requirement(line).name)
        for line in lines
        if Requirement(line).marker is not None
        and Requirement(line).marker.evaluate({"extra": "testing"})  # type: ignore[union-attr]
    }
    assert {"pytest", "hypothesis", "numpy"} <= testing, testing


def test_triton_backend_brings_what_its_cpu_advice_needs(wheels: dict[str, Path]) -> None:
    """On a CPU the backend says 'set TRITON_INTERPRET=1'; Triton's interpreter imports NumPy,
    which Triton does not declare, so a stranger following that advice needs it installed."""
    backend = REPO / "plugins/triton_backend/src/fusedhead_triton/backend.py"
    assert "TRITON_INTERPRET=1 to run the kernels on the CPU" in backend.read_text()
    always, _ = requirements(metadata(wheels["fusedhead-triton"]))
    assert "numpy" in always, always


@pytest.mark.parametrize("dist", list(DISTS))
def test_classifiers_say_typed_and_match_requires_python(
    wheels: dict[str, Path], dist: str
) -> None:
    meta = metadata(wheels[dist])
    classifiers = meta.get_all("Classifier") or []
    with zipfile.ZipFile(wheels[dist]) as z:
        assert f"{DISTS[dist][1]}/py.typed" in z.namelist()
    assert "Typing :: Typed" in classifiers, (dist, classifiers)
    supported = SpecifierSet(meta["Requires-Python"])
    versions = [
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert versions, (dist, classifiers)
    for v in versions:
        assert supported.contains(v), f"{dist}: classifier Python {v} outside {supported}"
    lowest = min(versions, key=lambda v: tuple(map(int, v.split("."))))
    assert not supported.contains(f"3.{int(lowest.split('.')[1]) - 1}"), (
        f"{dist}: Requires-Python {supported} admits a Python below its lowest classifier {lowest}"
    )
