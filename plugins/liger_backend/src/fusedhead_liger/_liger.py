"""Lazy access to the three liger-kernel functions the adapter runs, each called directly.

Liger's public ``LigerFusedLinearScaledCrossEntropyFunction`` picks its implementation from the
device; the adapter never calls it, so nothing is chosen behind the user's back. Two of the
functions are private names of liger-kernel 0.8.5 (pinned exactly), so a missing name is reported
as a version problem rather than an AttributeError. Importing liger-kernel takes seconds, hence
every import here happens on first use.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
from typing import Any

from fusedhead.errors import BackendLoadError, MissingDependencyError

TESTED_LIGER = "0.8.5"
TESTED_CUTE_DSL = "4.8.1"

_FALLBACK_MODULE = "liger_kernel.ops.fused_linear_scaled_cross_entropy"
_NATIVE_MODULE = "liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90"

#: The SM90 CuTe DSL kernel (bf16, compute capability 9.0 only).
NATIVE_FUNCTION = f"{_NATIVE_MODULE}.LigerFusedScaledCrossEntropySM90Function"
#: The 512-row chunked path adapted from verl, single process.
FALLBACK_FUNCTION = f"{_FALLBACK_MODULE}._FusedLinearPPOFallbackFunction"
#: The same chunked path over a vocabulary-parallel process group.
TP_FALLBACK_FUNCTION = f"{_FALLBACK_MODULE}._TensorParallelFusedLinearPPOFallbackFunction"


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


def _attribute(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "liger_kernel":
            raise MissingDependencyError(
                "fusedhead-liger needs liger-kernel: pip install liger-kernel==0.8.5 (the version it pins)"
            ) from exc
        raise
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        found = distribution_version("liger-kernel")
        raise BackendLoadError(
            f"liger-kernel {found} has no {dotted}; fusedhead-liger is built and tested against "
            f"liger-kernel=={TESTED_LIGER}: pip install liger-kernel=={TESTED_LIGER}"
        ) from exc


@functools.cache
def fallback_function() -> Any:
    """Liger's chunked single-process function (runs on any device and dtype)."""
    return _attribute(FALLBACK_FUNCTION)


@functools.cache
def tp_fallback_function() -> Any:
    """Liger's chunked vocabulary-parallel function (all-reduces the hidden gradient)."""
    return _attribute(TP_FALLBACK_FUNCTION)


@functools.cache
def native_import_error() -> str | None:
    """Why Liger's SM90 module cannot be imported here, or None when it can (tried once)."""
    try:
        _attribute(NATIVE_FUNCTION)
    except Exception as exc:  # the CuTe DSL raises RuntimeError too (no CUDA flavor, old driver)
        return f"{type(exc).__name__}: {exc}"
    return None


def native_function() -> Any:
    """Liger's SM90 CuTe DSL function; call only after ``native_import_error()`` is None."""
    return _attribute(NATIVE_FUNCTION)
