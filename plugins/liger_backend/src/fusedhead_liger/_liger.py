"""Lazy access to the three liger-kernel functions the adapter runs, each called directly.

Liger's public ``LigerFusedLinearScaledCrossEntropyFunction`` picks its implementation from the
device; the adapter never calls it, so nothing is chosen behind the user's back. Two of the
functions are private names of liger-kernel 0.8.5, so the installed version is checked against
that pin before anything is imported (:func:`require_liger`): another release is refused by name,
not run with arguments its functions may read differently. Importing liger-kernel takes seconds,
hence every import here happens on first use, and a failure of that import is reported as
liger-kernel's, with the environment variables it read.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
import os
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from fusedhead.errors import BackendLoadError, BackendUnavailableError, MissingDependencyError

TESTED_LIGER = "0.8.5"
TESTED_CUTE_DSL = "4.8.1"
#: The liger-kernel releases the adapter runs with: the pin of its pyproject.toml.
SUPPORTED_LIGER = SpecifierSet(f"=={TESTED_LIGER}")
_INSTALL = f"pip install liger-kernel=={TESTED_LIGER}"
#: Prefix of the environment variables liger-kernel reads, some when it is imported
#: (``LIGER_KERNEL_IMPL`` picks the implementation its ``ops`` package loads).
_ENV_PREFIX = "LIGER_"

_FALLBACK_MODULE = "liger_kernel.ops.fused_linear_scaled_cross_entropy"
_NATIVE_MODULE = "liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90"

#: The SM90 CuTe DSL kernel (bf16, compute capability 9.0 only).
NATIVE_FUNCTION = f"{_NATIVE_MODULE}.LigerFusedScaledCrossEntropySM90Function"
#: The 512-row chunked path adapted from verl, single process.
FALLBACK_FUNCTION = f"{_FALLBACK_MODULE}._FusedLinearPPOFallbackFunction"
#: The same chunked path over a vocabulary-parallel process group.
TP_FALLBACK_FUNCTION = f"{_FALLBACK_MODULE}._TensorParallelFusedLinearPPOFallbackFunction"


class LigerKernelMissing(MissingDependencyError, BackendUnavailableError):
    """liger-kernel (or a package it imports) is missing, or installed at a version the adapter
    does not run with. A ``MissingDependencyError`` (an ``ImportError``), and a
    ``BackendUnavailableError`` as ``check()`` raises it: ``fusedhead list --check`` shows the
    reason and the fix, not a breach of the plugin contract."""


class LigerKernelImportError(BackendLoadError, BackendUnavailableError):
    """liger-kernel is installed at the pinned version but its import fails (an environment
    variable it reads, a broken install), or lacks a name the adapter calls: liger-kernel's
    failure, named as such, and a ``BackendUnavailableError`` as ``check()`` raises it."""


def distribution_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cute_dsl_installed() -> bool:
    """Whether the CuTe DSL (``cutlass``) is installed, found without importing it."""
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def _module_found(name: str) -> bool:
    """Whether ``name`` can be found, without importing it (a finder that raises: not found)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_liger() -> str:
    """The installed liger-kernel version, after checking it is one the adapter runs with.

    Raises ``LigerKernelMissing`` (a ``MissingDependencyError``) naming liger-kernel, the version
    found and the one needed: the adapter calls private functions of one release, which another
    may change (a positional parameter added before ``return_entropy`` would move the adapter's
    arguments and return the NLL alone), so a version outside the pin could run wrongly rather
    than fail.
    """
    found = distribution_version("liger-kernel")
    if not _module_found("liger_kernel"):
        installed = f" (its metadata says {found}, but no liger_kernel module is found)"
        raise LigerKernelMissing(
            f"fusedhead-liger needs liger-kernel{SUPPORTED_LIGER}, which is not installed"
            + (installed if found else ""),
            missing="liger_kernel",
            hint=_INSTALL,
        )
    if found is None:
        raise LigerKernelMissing(
            "a liger_kernel module is importable but no liger-kernel distribution is installed, "
            f"so its version cannot be checked; fusedhead-liger needs liger-kernel{SUPPORTED_LIGER}",
            missing="liger_kernel",
            hint=_INSTALL,
        )
    try:
        supported = Version(found) in SUPPORTED_LIGER
    except InvalidVersion:
        supported = False
    if not supported:
        raise LigerKernelMissing(
            f"liger-kernel {found} is installed; fusedhead-liger needs liger-kernel"
            f"{SUPPORTED_LIGER}: it calls private functions of that release, whose signatures "
            "and outputs other releases change",
            hint=_INSTALL,
        )
    return found


def liger_environment() -> dict[str, str]:
    """The ``LIGER_*`` environment variables set in this process (liger-kernel reads them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIX)}


def _import_failed(version: str, module_name: str, exc: Exception) -> Exception:
    """liger-kernel's own import failure as the error to raise, blaming liger-kernel."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top != "liger_kernel":
            return LigerKernelMissing(
                f"liger-kernel {version} does not import: it needs the module {top!r}, which is "
                f"not installed ({what})",
                missing=top,
                hint=f"install the package that provides {top!r} (pip install "
                f"liger-kernel=={TESTED_LIGER} installs the ones liger-kernel declares)",
            )
    env = liger_environment()
    where = ""
    hint = (
        f"the failure is liger-kernel's own import of {module_name}; reinstall "
        f"liger-kernel=={TESTED_LIGER}, or report it to liger-kernel"
    )
    if env:
        shown = ", ".join(f"{k}={v!r}" for k, v in env.items())
        where = f"; the environment sets {shown}, which liger-kernel reads when it is imported"
        hint = f"unset {', '.join(env)} (or give a value liger-kernel takes on this machine)"
    return LigerKernelImportError(
        f"liger-kernel {version} fails to import {module_name} ({what}){where}",
        hint=hint,
    )


def _import(module_name: str) -> Any:
    """A liger-kernel module, after the version check; any import failure is liger-kernel's."""
    version = require_liger()
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # liger-kernel's import runs its backend selection: any exception
        raise _import_failed(version, module_name, exc) from exc


def _attribute(dotted: str, module: Any = None) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    if module is None:
        module = _import(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        found = distribution_version("liger-kernel")
        raise LigerKernelImportError(
            f"liger-kernel {found} has no {dotted}; fusedhead-liger is built and tested against "
            f"liger-kernel=={TESTED_LIGER}",
            hint=_INSTALL,
        ) from exc


@functools.cache
def fallback_function() -> Any:
    """Liger's chunked single-process function (CPU or CUDA; fp32, fp16 or bf16)."""
    return _attribute(FALLBACK_FUNCTION)


@functools.cache
def tp_fallback_function() -> Any:
    """Liger's chunked vocabulary-parallel function (all-reduces the hidden gradient)."""
    return _attribute(TP_FALLBACK_FUNCTION)


@functools.cache
def native_import_error() -> str | None:
    """Why Liger's SM90 module cannot be imported here, or None when it can (tried once).

    liger-kernel's own modules are imported first, and their failure raises as liger-kernel's
    (``_import``): only what the SM90 module adds, the CuTe DSL and its kernels, is a reason.
    """
    _import(_FALLBACK_MODULE)
    try:
        module = importlib.import_module(_NATIVE_MODULE)
    except Exception as exc:  # the CuTe DSL raises RuntimeError too (no CUDA flavor, old driver)
        return f"{type(exc).__name__}: {exc}"
    _attribute(NATIVE_FUNCTION, module)
    return None


@functools.cache
def native_function() -> Any:
    """Liger's SM90 CuTe DSL function; call only after ``native_import_error()`` is None."""
    return _attribute(NATIVE_FUNCTION)
