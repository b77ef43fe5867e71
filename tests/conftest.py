"""Fixtures shared by every test suite: real fixture distributions installed with pip."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def usable_cores() -> int:
    """The cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


# ``pytest -n auto`` runs one worker per core; torch's and OpenBLAS's thread pools on top of that
# oversubscribe the cores (the Triton interpreter's suites ran 27 % slower on two cores). Each
# worker takes its share of the cores, set before torch and NumPy load; subprocesses inherit it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(_share))

import pytest  # noqa: E402 (after the environment that torch and NumPy read)
import torch  # noqa: E402

# Triton decides when ``@triton.jit`` runs, its own standard library (tl.cdiv, tl.max, ...)
# included, whether a function is compiled or interpreted, and inductor's kernels for CUDA
# tensors are Triton's too: one process runs them all one way. So a session is either the CPU
# suite, as CI runs it, or a GPU session (``-m gpu``): on a CUDA machine the CPU suite hides the
# GPU (``CUDA_VISIBLE_DEVICES``, set in ``pytest_configure`` before anything asks CUDA) and skips
# the ``gpu`` tests with the reason; without CUDA the kernels run under the interpreter. Nothing
# here may ask ``torch.cuda`` before that.
from suite_sessions import (  # noqa: E402 (which session this is)
    GPU_SESSION_ONLY,
    HID_CUDA,
    has_cuda_device,
    is_gpu_session,
)

#: Most workers ``pytest -n auto`` starts (pytest-xdist): each imports torch and some tests spawn
#: process groups of their own, so a many-core machine gets this many, not one per core.
MAX_WORKERS = 8


def pytest_configure(config: pytest.Config) -> None:
    """Outside a GPU session hide CUDA; without it interpret Triton's kernels (before any test
    module imports triton), and spare the interpreter the re-patching its helper calls repeat."""
    if not is_gpu_session(config) and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        if os.environ.get(HID_CUDA) is None:  # the first process to decide (xdist workers inherit)
            os.environ[HID_CUDA] = "1" if has_cuda_device() else "0"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip_repatching_in_device_calls()


def skip_repatching_in_device_calls() -> None:
    """Triton's interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` walk of
    every module) on each call of a ``@triton.jit`` helper inside a kernel, though the launch
    has already patched those modules and restores them when it ends: half of the top-k kit's
    interpreter time. A helper call whose modules are already patched is let through as is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or scope is None or is_builtin is None:
        return  # another interpreter than the one this was written against: leave it alone

    def patched(lang: object) -> bool:
        math = getattr(lang, "math", None)
        return not is_builtin(lang.arange) and (math is None or not is_builtin(math.exp))  # type: ignore[attr-defined]

    def patch_lang(fn: Any) -> object:
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not is_builtin(tl.tensor.__add__) and all(map(patched, langs)):
            return scope()
        return original(fn)

    interpreter._patch_lang = patch_lang


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, usable_cores()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n``: work stealing rather than fixed batches, so an idle worker takes the other's
    pending tests instead of waiting for it (an explicit ``--dist`` other than load is kept)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a ``slow`` or ``multiprocess`` test go first, each kept whole (its fixtures
    set up once), so that under ``-n`` no long test is left running alone at the end. On a CUDA
    machine outside a GPU session, the ``gpu`` tests are skipped with the reason."""
    if os.environ.get(HID_CUDA) == "1" and not is_gpu_session(config):
        hidden = pytest.mark.skipif(True, reason=GPU_SESSION_ONLY)  # first: before the tests' own
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(hidden, append=False)
    heavy = {
        item.path
        for item in items
        if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess")
    }
    items.sort(key=lambda item: item.path not in heavy)


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
