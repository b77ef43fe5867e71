"""Packaging: scripts/build-dists builds every distribution and they work from a fresh venv.

Runs the script as CI and a release do (sdists, wheels built from them, one fresh venv with
torch, then the wheels, then the sdists rebuilt by pip) and reads its JSON report: each check the
script makes is asserted here again on what it recorded. Needs an index for the dependencies
(pydantic, pluggy, triton, liger-kernel) and takes one to three minutes on 2 cores.
"""

from __future__ import annotations

import importlib.machinery
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from dist_layout import DISTS, REPO, SCRIPT

BACKENDS = {
    "torch": "fusedhead-torch",
    "triton": "fusedhead-triton",
    "liger": "fusedhead-liger",
    "example-bi": "fusedhead-example-batchinvariant",
}

pytestmark = pytest.mark.packaging


def source_version(dist: str) -> str:
    project, package = DISTS[dist]
    text = (REPO / project / "src" / package / "__init__.py").read_text()
    return re.findall(r'^__version__ = "([^"]+)"', text, re.M)[0]


def test_build_dists_builds_installs_and_checks_every_distribution(tmp_path: Path) -> None:
    out, report_path = tmp_path / "dist", tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, out, "--report", report_path],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(report_path.read_text())
    versions = {d: source_version(d) for d in DISTS}
    assert report["versions"] == versions

    # Exactly one sdist and one wheel per distribution, nothing else (a release uploads them all).
    norm = {d: d.replace("-", "_") for d in DISTS}
    expected = {f"{norm[d]}-{v}.tar.gz" for d, v in versions.items()}
    expected |= {f"{norm[d]}-{v}-py3-none-any.whl" for d, v in versions.items()}
    assert {p.name for p in out.iterdir()} == expected == set(report["files"])
    for dist, (_, package) in DISTS.items():
        assert f"{package}/py.typed" in report["packaged"][dist]

    # The venvs got this interpreter's torch build (its +label kept), not PyPI's CUDA build.
    import torch

    assert report["torch"]["spec"] == f"torch=={torch.__version__}", report["torch"]
    assert set(report["venvs"]) == {"wheel", "sdist"}
    for kind, seen in report["venvs"].items():
        for dist, version in versions.items():
            assert any(line.startswith(f"{dist} {version}") for line in seen["version_output"]), (
                kind,
                seen["version_output"],
            )
        assert seen["list"] == {n: [d, versions[d], "installed"] for n, d in BACKENDS.items()}, kind
        assert seen["check"]["torch"] == seen["check"]["example-bi"] == "ok", (kind, seen["check"])
        assert seen["check"]["triton"] in ("ok", "unavailable")
        assert seen["check"]["liger"] in ("ok", "unavailable")
        call = seen["call"]
        assert call["file"].endswith("site-packages/fusedhead/__init__.py"), call
        assert not call["file"].startswith(str(REPO)), call
        assert call["version"] == versions["fusedhead"]
        assert call["log_prob_err"] < 1e-5 and call["entropy_err"] < 1e-5, call
        assert call["grad_finite"] and call["ignored_rows_grad_zero"], call
        assert call["cute_dsl_installed"] is False, "fusedhead[all] must not pull the CuTe DSL"
    # The sdist step really built from the sdists (pip -v named each one).
    log = "\n".join(report["venvs"]["sdist"]["log"])
    assert "--no-binary" in log and "--no-cache-dir" in log


def test_build_dists_refuses_a_folder_with_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, SCRIPT, tmp_path, "--no-check"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "files other than distributions" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def load_script() -> types.ModuleType:
    loader = importlib.machinery.SourceFileLoader("build_dists", str(SCRIPT))
    module = types.ModuleType(loader.name)
    module.__file__ = str(SCRIPT)
    loader.exec_module(module)
    return module


def test_venv_torch_is_this_build_from_its_index() -> None:
    """A CPU torch (``+cpu``) must not become PyPI's CUDA build (gigabytes) in the check venvs."""
    script = load_script()
    assert script.torch_requirement("2.13.0+cpu") == (
        "torch==2.13.0+cpu",
        "https://download.pytorch.org/whl/cpu",
    )
    assert script.torch_requirement("2.9.1+cu128") == (
        "torch==2.9.1+cu128",
        "https://download.pytorch.org/whl/cu128",
    )
    assert script.torch_requirement("2.13.0") == ("torch==2.13.0", None)


def test_torch_comes_from_pips_own_sources_before_the_labels_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A derived index is the fallback: where pip's cache or configured sources hold the build,
    nothing is fetched from PyTorch's index; where they do not, the index is used; an index the
    caller asked for is used at once."""
    script = load_script()
    calls: list[list[str]] = []
    fail_first = [True]

    def run(cmd: list[str], log: list[str]) -> str:
        calls.append([str(c) for c in cmd])
        if fail_first[0] and "--index-url" not in cmd:
            raise script.CheckError("no matching distribution")
        return ""

    monkeypatch.setattr(script, "run", run)
    index = "https://download.pytorch.org/whl/cpu"
    script.install_torch(["pip"], "torch==2.13.0+cpu", index, [], derived=True)
    assert calls == [
        ["pip", "-q", "torch==2.13.0+cpu"],
        ["pip", "-q", "torch==2.13.0+cpu", "--index-url", index],
    ]
    calls.clear()
    fail_first[0] = False
    script.install_torch(["pip"], "torch==2.13.0+cpu", index, [], derived=True)
    assert calls == [["pip", "-q", "torch==2.13.0+cpu"]]
    calls.clear()
    script.install_torch(["pip"], "torch==2.13.0+cpu", index, [], derived=False)
    assert calls == [["pip", "-q", "torch==2.13.0+cpu", "--index-url", index]]
