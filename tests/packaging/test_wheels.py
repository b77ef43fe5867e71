"""Packaging: wheels of every distribution install into a fresh venv and register their backends.

Builds the wheels of core, plugins/* and the example; in a new virtual environment (no system
site-packages) installs torch==2.13.0 first, then ``fusedhead[torch]`` from those wheels, then
``fusedhead[all]``, then the example plugin, checking ``fusedhead list`` after each step.
Needs PyPI for the dependencies that are not on the local disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECTS = [
    "core",
    "plugins/torch_backend",
    "plugins/triton_backend",
    "plugins/liger_backend",
    "examples/third_party_backend",
]
TORCH = "torch==2.13.0"

pytestmark = pytest.mark.packaging


def _env() -> dict[str, str]:
    """The caller's environment without anything that would leak the dev install into the venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {"PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "FUSEDHEAD_BACKENDS", "PYTHONHOME"}
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*cmd: str | Path, cwd: Path | None = None, ok: tuple[int, ...] = (0,)) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600
    )
    if proc.returncode not in ok:
        tail = (proc.stdout + proc.stderr)[-4000:]
        pytest.fail(f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{tail}", pytrace=False)
    return proc.stdout


def _listing(venv: Path, *flags: str) -> dict[str, dict]:
    rows = json.loads(_run(venv / "bin" / "fusedhead", "list", "--json", *flags))
    return {row["name"]: row for row in rows}


def _build_wheels(dist: Path) -> dict[str, Path]:
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        *isolation,
        "-w",
        dist,
        *(f"./{p}" for p in PROJECTS),
        cwd=REPO,
    )
    wheels = {w.name.split("-")[0]: w for w in dist.glob("*.whl")}
    assert set(wheels) == {
        "fusedhead",
        "fusedhead_torch",
        "fusedhead_triton",
        "fusedhead_liger",
        "fusedhead_example_batchinvariant",
    }
    return wheels


def test_wheels_install_into_a_fresh_venv_and_register_their_backends(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    venv = tmp_path / "venv"
    wheels = _build_wheels(dist)
    try:
        _run(sys.executable, "-m", "venv", venv)
        pip = (venv / "bin" / "python", "-m", "pip", "install", "-q", "--find-links", dist)
        _run(*pip, TORCH)

        # fusedhead[torch]: only the torch backend, installed (metadata) and ok (probed).
        _run(*pip, "fusedhead[torch]==0.1.0")
        origin = _run(
            venv / "bin" / "python",
            "-c",
            "import fusedhead, fusedhead_torch; print(fusedhead.__file__)",
        )
        assert origin.startswith(str(venv)), (
            f"fusedhead was imported from {origin!r}, not the fresh venv"
        )
        rows = _listing(venv)
        assert set(rows) == {"torch"}, rows
        assert rows["torch"]["status"] == "installed"
        assert rows["torch"]["distribution"] == "fusedhead-torch"
        assert _listing(venv, "--check", "--device", "cpu")["torch"]["status"] == "ok"

        # fusedhead[all]: torch, triton and liger; on a CPU triton and liger say why they cannot run.
        _run(*pip, "fusedhead[all]==0.1.0")
        rows = _listing(venv)
        assert set(rows) == {"torch", "triton", "liger"}, rows
        checked = _listing(venv, "--check", "--device", "cpu")
        assert checked["torch"]["status"] == "ok"
        for name in ("triton", "liger"):
            row = checked[name]
            assert row["status"] in ("unavailable", "ok"), f"{name} must import cleanly, got {row}"
            if row["status"] == "unavailable":
                assert row.get("reason"), f"{name} is unavailable without a reason"

        # The third-party example: appears once installed, probes ok, and passes the kit from the wheel.
        _run(*pip, wheels["fusedhead_example_batchinvariant"])
        rows = _listing(venv, "--check", "--device", "cpu")
        assert rows["example-bi"]["status"] == "ok", rows["example-bi"]
        assert rows["example-bi"]["distribution"] == "fusedhead-example-batchinvariant"
        out = _run(
            venv / "bin" / "fusedhead",
            "check",
            "example-bi",
            "-k",
            "forward_accuracy,batch_invariance",
        )
        assert "PASS forward_accuracy" in out and "PASS batch_invariance" in out, out
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 2.5 GB
