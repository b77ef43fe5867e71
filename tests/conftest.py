"""Fixtures shared by every test suite: real fixture distributions installed with pip."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

# The Triton interpreter's tl.dot is NumPy's matmul. OpenBLAS's Haswell and Zen sgemm kernels
# (NumPy's BLAS; 2.3.5 and 2.4.6 alike) give a row bits that depend on the row's place in the
# matrix (a row tile permuted or shifted gives other last bits), so under them the interpreter's
# bitwise batch-invariance and top-k tie checks fail while the kernels are invariant (as on the
# GPU). Which kernels load depends on the CPU and on OPENBLAS_CORETYPE, which some machine images
# set to Haswell. OpenBLAS's Sandybridge kernels (AVX: every x86-64 CPU of the last decade) are
# row-invariant, so the test session takes them; the choice is read when OpenBLAS loads, before
# NumPy is imported.
if platform.machine().lower() in ("x86_64", "amd64") and "numpy" not in sys.modules:
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest
import torch

# Triton decides when ``@triton.jit`` runs, its own standard library (tl.cdiv, tl.max, ...)
# included, whether a function is compiled or interpreted; a later switch cannot reach functions
# made earlier. Without a GPU, every Triton kernel in this session runs under the interpreter, so
# the switch is made here, before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Most workers ``pytest -n auto`` starts (pytest-xdist): each imports torch and some tests spawn
#: process groups of their own, so a many-core machine gets this many, not one per core.
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, at most ``MAX_WORKERS``."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))


FIXTURE_DISTS = Path(__file__).parent / "fixtures" / "dists"
#: Distributions that break the plugin rules on purpose (tests/core/test_faults.py).
FAULT_DISTS = Path(__file__).parent / "fixtures" / "faults"


def pip_install_target(target: Path, *projects: Path) -> None:
    """Build and install projects into ``target`` with pip (no deps, no index needed)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            *map(str, projects),
        ],
        check=True,
    )


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where every fixture distribution under tests/fixtures/dists is pip-installed."""
    target = tmp_path_factory.mktemp("fixture-site")
    pip_install_target(target, *sorted(p for p in FIXTURE_DISTS.iterdir() if p.is_dir()))
    return target


@pytest.fixture(scope="session")
def fault_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the fault distributions (and the good fixture they build on) pip-installed."""
    target = tmp_path_factory.mktemp("fault-site")
    pip_install_target(target, FIXTURE_DISTS / "good", *sorted(FAULT_DISTS.iterdir()))
    return target


@pytest.fixture
def site_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], Path]]:
    """``put(site)``: a folder of installed distributions on sys.path (and PYTHONPATH for
    subprocesses) for one test, with the registry's discovery refreshed on entry and exit."""
    from fusedhead import registry

    def put(site: Path) -> Path:
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
        )
        registry.refresh()
        return site

    before = set(sys.modules)
    yield put
    for name in [m for m in sys.modules if m.startswith("fh_") and m not in before]:
        del sys.modules[name]  # fixture plugins imported here must not leak into later tests
    registry.refresh()


@pytest.fixture
def with_fixture_dists(fixture_site: Path, site_on_path: Callable[[Path], Path]) -> Path:
    """Put the fixture distributions on sys.path (and PYTHONPATH for subprocesses) for one test."""
    return site_on_path(fixture_site)


@pytest.fixture
def install_fixture_dist() -> object:
    """``install(target, name)``: pip-install the fixture distribution ``name`` into ``target``."""
    return lambda target, name: pip_install_target(target, FIXTURE_DISTS / name)
